#!/usr/bin/env bash
# docker/smoke.sh: the project's own end-to-end check of the image, on a CPU machine like CI's
# (root, Debian, no Docker Hub, no CUDA index). CI runs it after the test suite (.ci/run).
#
#   docker/smoke.sh            build the CPU variant, run the checks, clean up (keeps the caches)
#   docker/smoke.sh --purge    remove what earlier runs cached (stand-in bases, image, wheels)
#
# What it does:
#  1. the container engine: a daemon already answering `docker info` is used as it is; otherwise,
#     as root, it installs `docker.io` (and `debootstrap`) from the distribution's packages where
#     missing and starts its own dockerd (own socket, data root $SMOKE_STATE/docker, no bridge and
#     no iptables rules: builds use the host's network, runs `--network none`), stopped at the end;
#  2. stand-in base images without any registry: a debootstrapped Debian bookworm, `docker import`ed
#     (BASE_IMAGE, for nvidia/cuda), and the same plus a Python 3.11 venv (BUILDER_IMAGE, for
#     python:3.11-slim-bookworm); kept, so later runs reuse them;
#  3. a local package index: the pinned CPU torch wheel found on this machine (TORCH_WHEEL, else pip's
#     find-links folders, /opt/wheels, ~/.cache) and the project's other dependencies as wheels
#     (fetched once from the configured package index, then cached), served by `python3 -m
#     http.server` on 127.0.0.1 only;
#  4. the CPU variant through the build arguments (BASE_IMAGE, BUILDER_IMAGE, TORCH_INDEX_URL,
#     PIP_INDEX_URL, PIP_TRUSTED_HOST, CA_CERT) with the legacy builder (DOCKER_BUILDKIT=0); a
#     rebuild after a source edit (the apt layer, torch and the dependencies must come from the
#     cache); the builder stage once more with BuildKit (no frontend image may be fetched);
#  5. the checks, by exit codes and files: --help; run.sh without a GPU; a 3-step smoke run with the
#     Debian lists mounted read-only (the README's "one machine" steps, as a non-root host user);
#     one with the data built into the image, as an arbitrary uid; `docker stop` mid-run (exit 143,
#     last.ckpt, the printed resume command) and that command finishing; the same with 2 torchrun
#     processes in one container.
# It prints one line per check and ends with "smoke: N passed, M failed"; status 1 when a check
# failed. Where no container engine can start (not root and no daemon, or the daemon does not
# start), it says so and exits 0, except under CI (CI=true) or SMOKE_REQUIRED=1, where that fails.
#
# Environment: SMOKE_DEBIAN_DIR (default ../shared/data/debian-bookworm beside the repository),
# SMOKE_STATE (/var/lib/moco-retrieval-smoke: docker data root), SMOKE_CACHE
# (/var/cache/moco-retrieval-smoke: wheels), DEBIAN_MIRROR (default: this machine's apt source),
# TORCH_WHEEL (the CPU wheel of the pinned torch), SMOKE_INDEX_PORT (38517: the local index, on
# 127.0.0.1), SMOKE_RUN_TIMEOUT (600 s per container run), SMOKE_KEEP=1 (keep the work folder).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SMOKE_STATE="${SMOKE_STATE:-/var/lib/moco-retrieval-smoke}"
SMOKE_CACHE="${SMOKE_CACHE:-/var/cache/moco-retrieval-smoke}"
SMOKE_DEBIAN_DIR="${SMOKE_DEBIAN_DIR:-$ROOT/../shared/data/debian-bookworm}"
RUN_ROOT=/run/moco-retrieval-smoke
LABEL=moco-retrieval-smoke
STANDIN=1 # bump when the stand-in recipes below change
BASE_TAG="$LABEL/bookworm:base-$STANDIN"
BUILDER_TAG="$LABEL/bookworm:python3.11-$STANDIN"
IMAGE="moco-retrieval:smoke-cpu"
SUITE=bookworm
RUN_TIMEOUT="${SMOKE_RUN_TIMEOUT:-600}"

T0=$SECONDS
passed=0
failed=0
failures=()
started_dockerd=""
http_pid=""
WORK=""

say() { printf '[smoke %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
pass() {
  passed=$((passed + 1))
  say "PASS $*"
}
fail() {
  failed=$((failed + 1))
  failures+=("$1")
  say "FAIL $*"
}
die() {
  fail "$*"
  exit 1
}
required() { [[ "${CI:-}" == true || "${SMOKE_REQUIRED:-0}" == 1 ]]; }
skipped=""
skip() {
  if required; then
    die "no container engine: $*"
  fi
  say "SKIP: no container engine can start here: $*"
  skipped=1
  exit 0
}

if [[ "${1:-}" == --purge ]]; then
  [[ "$(id -u)" == 0 ]] || { echo "--purge: run as root" >&2; exit 2; }
  if [[ -S "$RUN_ROOT/docker.sock" ]] && DOCKER_HOST="unix://$RUN_ROOT/docker.sock" docker info >/dev/null 2>&1; then
    echo "a smoke run is in progress ($RUN_ROOT/docker.sock answers): not purging" >&2
    exit 1
  fi
  rm -rf "$SMOKE_STATE" "$SMOKE_CACHE"
  echo "removed $SMOKE_STATE and $SMOKE_CACHE"
  exit 0
elif [[ $# -gt 0 ]]; then
  sed -n '2,8p' "${BASH_SOURCE[0]}"
  exit 2
fi

cleanup() {
  local rc=$?
  set +e
  if [[ -n "${DOCKER_HOST_SET:-}" ]]; then
    local ids
    ids="$(docker ps -aq --filter "label=$LABEL" 2>/dev/null)"
    if [[ -n "$ids" ]]; then
      # shellcheck disable=SC2086 # one id per word
      docker rm -f $ids >/dev/null 2>&1
    fi
    docker image rm "$LABEL/builder:buildkit" >/dev/null 2>&1
  fi
  if [[ -n "$http_pid" ]]; then
    kill "$http_pid" 2>/dev/null
    wait "$http_pid" 2>/dev/null
  fi
  if [[ -n "$started_dockerd" ]]; then
    kill "$started_dockerd" 2>/dev/null
    for _ in $(seq 60); do
      kill -0 "$started_dockerd" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "$started_dockerd" 2>/dev/null; then
      say "dockerd (pid $started_dockerd) did not stop in 30 s; its log: $RUN_ROOT/dockerd.log"
    elif ((failed > 0)); then
      say "dockerd's log: $RUN_ROOT/dockerd.log"
    else
      # what dockerd leaves mounted (its default network namespace), then its run folder
      awk -v root="$RUN_ROOT/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
      done
      rm -rf --one-file-system "$RUN_ROOT"
    fi
  fi
  if [[ -n "$WORK" && "${SMOKE_KEEP:-0}" != 1 ]]; then
    rm -rf "$WORK"
  elif [[ -n "$WORK" ]]; then
    say "work folder kept: $WORK"
  fi
  say "total $((SECONDS - T0)) s"
  if [[ -n "$skipped" ]]; then
    echo "smoke: skipped (no container engine)"
    exit 0
  fi
  printf 'smoke: %d passed, %d failed\n' "$passed" "$failed"
  if ((failed > 0)); then
    printf '  failed: %s\n' "${failures[@]}"
    rc=1
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------------ 1. the container engine
apt_install() {
  say "installing $* from the distribution's packages"
  # with the recommended packages (apparmor among them: a kernel with AppArmor needs its parser)
  if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=l apt-get install -y -qq "$@") \
      >"${TMPDIR:-/tmp}/moco-smoke-apt.log" 2>&1; then
    tail -20 "${TMPDIR:-/tmp}/moco-smoke-apt.log" >&2
    return 1
  fi
  rm -f "${TMPDIR:-/tmp}/moco-smoke-apt.log"
}

if docker info >/dev/null 2>&1; then
  say "using the running engine ($(docker info --format '{{.ServerVersion}}' 2>/dev/null))"
else
  [[ "$(id -u)" == 0 ]] || skip "no daemon answers and this is not root (cannot install or start one)"
  if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || skip "no dockerd and no apt-get to install it"
    apt_install docker.io || skip "apt-get install docker.io failed"
  fi
  mkdir -p "$RUN_ROOT" "$SMOKE_STATE/docker"
  if [[ -S "$RUN_ROOT/docker.sock" ]] && DOCKER_HOST="unix://$RUN_ROOT/docker.sock" docker info >/dev/null 2>&1; then
    die "another smoke run's dockerd answers on $RUN_ROOT/docker.sock"
  fi
  rm -f "$RUN_ROOT/docker.sock" "$RUN_ROOT/docker.pid"
  say "starting dockerd ($(dockerd --version 2>/dev/null)), data root $SMOKE_STATE/docker"
  dockerd --host "unix://$RUN_ROOT/docker.sock" --pidfile "$RUN_ROOT/docker.pid" \
    --exec-root "$RUN_ROOT/exec" --data-root "$SMOKE_STATE/docker" \
    --bridge=none --iptables=false --ip6tables=false >"$RUN_ROOT/dockerd.log" 2>&1 &
  started_dockerd=$!
  export DOCKER_HOST="unix://$RUN_ROOT/docker.sock"
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$started_dockerd" 2>/dev/null || break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    tail -20 "$RUN_ROOT/dockerd.log" >&2
    kill "$started_dockerd" 2>/dev/null
    started_dockerd=""
    skip "dockerd did not start (its log: $RUN_ROOT/dockerd.log)"
  fi
fi
DOCKER_HOST_SET=1
say "engine: server $(docker info --format '{{.ServerVersion}}'), client $(docker version --format '{{.Client.Version}}')"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/moco-smoke.XXXXXX")"
chmod 755 "$WORK" # the host users below create folders in it

# ------------------------------------------------------------------ 2. stand-in base images
debian_mirror() {
  local uri
  uri="$(sed -n 's/^URIs:[[:space:]]*\(http[^[:space:]]*\/debian\)\/\{0,1\}[[:space:]]*$/\1/p' \
    /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)"
  [[ -n "$uri" ]] || uri="$(sed -n 's/^deb[[:space:]]\+\(http[^[:space:]]*\/debian\)\/\{0,1\}[[:space:]].*/\1/p' \
    /etc/apt/sources.list 2>/dev/null | head -1)"
  printf '%s\n' "${uri:-http://deb.debian.org/debian}"
}

if docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  say "stand-in base $BASE_TAG: cached"
else
  if ! command -v debootstrap >/dev/null 2>&1; then
    [[ "$(id -u)" == 0 ]] || die "debootstrap is missing (apt-get install debootstrap, as root)"
    apt_install debootstrap || die "apt-get install debootstrap failed"
  fi
  mirror="${DEBIAN_MIRROR:-$(debian_mirror)}"
  say "debootstrap $SUITE from $mirror"
  if ! debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$WORK/rootfs" "$mirror" \
      >"$WORK/debootstrap.log" 2>&1; then
    tail -20 "$WORK/debootstrap.log" >&2
    die "debootstrap $SUITE"
  fi
  rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
  tar -C "$WORK/rootfs" -c . | docker import --change 'CMD ["bash"]' - "$BASE_TAG" >/dev/null
  rm -rf "$WORK/rootfs"
  say "stand-in base $BASE_TAG: imported"
fi
if docker image inspect "$BUILDER_TAG" >/dev/null 2>&1; then
  say "stand-in builder $BUILDER_TAG: cached"
else
  docker build --network host -t "$BUILDER_TAG" - >"$WORK/builder-base.log" 2>&1 <<EOF || { tail -20 "$WORK/builder-base.log" >&2; die "stand-in builder image"; }
FROM $BASE_TAG
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3.11-venv \\
 && rm -rf /var/lib/apt/lists/* && python3.11 -m venv /opt/python
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
CMD ["python"]
EOF
  say "stand-in builder $BUILDER_TAG: built"
fi

# ------------------------------------------------------------------ 3. the local package index
TORCH_VERSION="$(sed -n 's/^ARG TORCH_VERSION=//p' "$ROOT/docker/Dockerfile")"
[[ -n "$TORCH_VERSION" ]] || die "no ARG TORCH_VERSION in docker/Dockerfile"
find_torch_wheel() {
  local name="torch-${TORCH_VERSION}+cpu-cp311-cp311-*linux*_x86_64.whl" dirs=() d f
  if [[ -n "${TORCH_WHEEL:-}" ]]; then
    printf '%s\n' "$TORCH_WHEEL"
    return
  fi
  for d in $(python3 -m pip config list 2>/dev/null | sed -n "s/.*find-links='\\([^']*\\)'.*/\\1/p"); do
    dirs+=("${d#file://}")
  done
  dirs+=("$HOME/.cache/pip" "$SMOKE_CACHE/torch")  # after the find-links pip is configured with
  for d in "${dirs[@]}"; do
    [[ -d "$d" ]] || continue
    f="$(find "$d" -maxdepth 6 -name "$name" -print -quit 2>/dev/null)"
    if [[ -n "$f" ]]; then
      printf '%s\n' "$f"
      return
    fi
  done
}
torch_wheel="$(find_torch_wheel)"
if [[ -z "$torch_wheel" || ! -f "$torch_wheel" ]]; then
  die "no CPU wheel of torch $TORCH_VERSION on this machine (set TORCH_WHEEL=path; PyPI's default Linux torch is the CUDA build, gigabytes, and is not fetched)"
fi
say "torch: $torch_wheel"

# the dependencies the image installs: the Dockerfile's builder stage computes the same list
python3 - "$ROOT/pyproject.toml" >"$WORK/requirements.txt" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["stream"]
print("\n".join(d for d in deps if re.split(r"[^A-Za-z0-9._-]", d, maxsplit=1)[0].lower() != "torch"))
EOF
printf 'torch==%s+cpu\nsetuptools>=68\nwheel\n' "$TORCH_VERSION" >>"$WORK/requirements.txt"
key="$( (cat "$WORK/requirements.txt" "$ROOT/requirements-nodeps.txt"; basename "$torch_wheel") | sha256sum | cut -c1-16)"
wheels="$SMOKE_CACHE/wheels-$key"
if [[ -f "$wheels/.complete" ]]; then
  say "wheels: cached ($wheels)"
else
  say "wheels: fetching the dependencies into $wheels (Python 3.11 of the stand-in builder)"
  rm -rf "$wheels.tmp"
  mkdir -p "$wheels.tmp"
  # this machine's CA bundle: an egress that presents its own CA is trusted here, so there too
  bundle="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
  cert=()
  [[ -f "$bundle" ]] && cert=(-v "$bundle:/etc/ssl/certs/host-bundle.crt:ro" -e PIP_CERT=/etc/ssl/certs/host-bundle.crt)
  if ! docker run --rm --network host --label "$LABEL" "${cert[@]}" \
      -v "$wheels.tmp:/wheels" -v "$(dirname "$torch_wheel"):/torch:ro" -v "$WORK/requirements.txt:/requirements.txt:ro" \
      -v "$ROOT/requirements-nodeps.txt:/requirements-nodeps.txt:ro" \
      "$BUILDER_TAG" sh -c 'pip wheel --quiet --disable-pip-version-check --use-pep517 --wheel-dir /wheels \
      --find-links /torch --prefer-binary -r /requirements.txt \
      && pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir /wheels -r /requirements-nodeps.txt' \
      >"$WORK/wheels.log" 2>&1; then
    tail -30 "$WORK/wheels.log" >&2
    die "fetching the dependencies' wheels"
  fi
  touch "$wheels.tmp/.complete"
  rm -rf "$wheels"
  mv "$wheels.tmp" "$wheels"
fi
# a PEP 503 index: simple/<normalized name>/<wheels>; http.server's folder listings are its pages
python3 - "$wheels" "$WORK/index/simple" <<'EOF'
import os, re, sys
src, dst = sys.argv[1:]
for f in sorted(os.listdir(src)):
    if f.endswith(".whl"):
        name = re.sub(r"[-_.]+", "-", f.split("-", 1)[0]).lower()
        os.makedirs(os.path.join(dst, name), exist_ok=True)
        os.symlink(os.path.join(src, f), os.path.join(dst, name, f))
EOF
# A fixed port: the index URL is a build argument, and another URL each run would rebuild every
# layer after it. When that port is taken, any free one (and a full rebuild).
start_index() {
  python3 -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$1" >"$WORK/http.log" 2>&1 &
  http_pid=$!
  port=""
  for _ in $(seq 50); do
    port="$(sed -n 's/.*port \([0-9]\+\).*/\1/p' "$WORK/http.log" | head -1)"
    [[ -n "$port" ]] && return 0
    kill -0 "$http_pid" 2>/dev/null || break
    sleep 0.2
  done
  kill "$http_pid" 2>/dev/null
  wait "$http_pid" 2>/dev/null
  http_pid=""
  return 1
}
if ! start_index "${SMOKE_INDEX_PORT:-38517}"; then
  say "port ${SMOKE_INDEX_PORT:-38517} is taken: the local index takes another (the build cache will not match)"
  start_index 0 || die "the local index did not start: $(cat "$WORK/http.log")"
fi
INDEX="http://127.0.0.1:$port/simple/"
say "local index: $INDEX ($(find "$WORK/index/simple" -name '*.whl' | wc -l) wheels), 127.0.0.1 only"

# ------------------------------------------------------------------ 4. the CPU variant
# A throwaway CA, made once and cached (a new one each run would defeat the layer cache): the
# build must install it and still build.
if [[ ! -f "$SMOKE_CACHE/ca.pem" ]]; then
  mkdir -p "$SMOKE_CACHE"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=moco-retrieval smoke CA" \
    -keyout /dev/null -out "$SMOKE_CACHE/ca.pem" >/dev/null 2>&1 || die "openssl: a test CA"
fi
build_args=(
  --build-arg "BASE_IMAGE=$BASE_TAG"
  --build-arg "BUILDER_IMAGE=$BUILDER_TAG"
  --build-arg "TORCH_INDEX_URL=$INDEX"
  --build-arg "PIP_INDEX_URL=$INDEX"
  --build-arg "PIP_TRUSTED_HOST=127.0.0.1:$port"
  --build-arg "CA_CERT=$(cat "$SMOKE_CACHE/ca.pem")"
)
old_image="$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
say "building $IMAGE (legacy builder, stand-in bases, local index)"
t=$SECONDS
if DOCKER_BUILDKIT=0 nice -n 10 docker build --network host -f "$ROOT/docker/Dockerfile" -t "$IMAGE" \
    "${build_args[@]}" "$ROOT" >"$WORK/build.log" 2>&1; then
  pass "build: CPU variant through the build args, legacy builder ($((SECONDS - t)) s)"
else
  tail -40 "$WORK/build.log" >&2
  die "build: CPU variant (legacy builder)"
fi
new_image="$(docker image inspect --format '{{.Id}}' "$IMAGE")"
if [[ -n "$old_image" && "$old_image" != "$new_image" ]]; then
  docker image rm "$old_image" >/dev/null 2>&1 || true # the previous run's image, now replaced
fi
say "image: $(docker image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}')"

# A source edit rebuilds only what follows the project's files: the apt layer (the default data),
# torch and the other dependencies come from the cache, so no apt-get update reaches the network.
mkdir -p "$WORK/edited"
cp -a "$ROOT/pyproject.toml" "$ROOT/requirements-nodeps.txt" "$ROOT/README.md" "$ROOT/.dockerignore" "$ROOT/conf" "$ROOT/moco_retrieval" "$ROOT/docker" "$WORK/edited/"
# (a new edit each run: an earlier run's edited layers may still be in the cache)
printf '\n# an edit (docker/smoke.sh, %s)\n' "$(date +%s%N)" >>"$WORK/edited/moco_retrieval/__init__.py"
t=$SECONDS
if DOCKER_BUILDKIT=0 nice -n 10 docker build --network host -f "$WORK/edited/docker/Dockerfile" -t "$LABEL/edited:latest" \
    "${build_args[@]}" "$WORK/edited" >"$WORK/edited.log" 2>&1; then
  # the legacy builder's log: "Step N/M : RUN ..." then " ---> Using cache" or " ---> Running in ..."
  cached="$(awk '/^Step /{step=$0} / ---> Using cache/{print step}' "$WORK/edited.log")"
  ran="$(awk '/^Step /{step=$0} / ---> Running in /{print step}' "$WORK/edited.log")"
  if grep -q "apt-get update" <<<"$cached" && grep -q "torch==" <<<"$cached" \
      && grep -q -- "-r /opt/venv/requirements.txt" <<<"$cached" && ! grep -q "apt-get update" <<<"$ran" \
      && grep -q "pip wheel" <<<"$ran"; then
    pass "rebuild after a source edit: apt data, torch and dependencies from the cache ($((SECONDS - t)) s)"
  else
    printf '%s\n' "ran:" "$ran" | sed 's/^/    | /' >&2
    fail "rebuild after a source edit: a layer before the project's files ran again"
  fi
else
  tail -20 "$WORK/edited.log" >&2
  fail "rebuild after a source edit"
fi
# the edited image and the layers its build made (the builder stage's too), not the cached ones
docker image rm "$LABEL/edited:latest" >/dev/null 2>&1 || true
awk '/^Step [0-9]+\/[0-9]+ : /{from = ($4 == "FROM"); cached = 0}
  / ---> Using cache/{cached = 1}
  / ---> [0-9a-f]+$/{if (!from && !cached) print $2}' "$WORK/edited.log" | tac |
  while read -r id; do docker image rm "$id" >/dev/null 2>&1 || true; done

# BuildKit: a client with the buildx plugin, or one from before Docker 23 (BuildKit built in), e.g.
# the engine package's own /usr/bin/docker when a newer client without buildx comes first on PATH
buildkit_client() {
  local c major
  if docker buildx version >/dev/null 2>&1; then
    command -v docker
    return
  fi
  for c in $(type -ap docker) /usr/bin/docker; do
    major="$("$c" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)"
    if [[ "$major" =~ ^[0-9]+$ ]] && ((major < 23)); then
      printf '%s\n' "$c"
      return
    fi
  done
}
t=$SECONDS
bk="$(buildkit_client)"
if [[ -z "$bk" ]]; then
  fail "build: builder stage with BuildKit: no client with BuildKit (install the buildx plugin)"
elif DOCKER_BUILDKIT=1 nice -n 10 "$bk" build --network host --target builder -f "$ROOT/docker/Dockerfile" \
    -t "$LABEL/builder:buildkit" "${build_args[@]}" "$ROOT" >"$WORK/buildkit.log" 2>&1; then
  pass "build: builder stage with BuildKit ($bk), no frontend image fetched ($((SECONDS - t)) s)"
else
  tail -20 "$WORK/buildkit.log" >&2
  fail "build: builder stage with BuildKit ($bk)"
fi

# the CA reached the image's trust store
if docker run --rm --network none --label "$LABEL" --entrypoint /bin/sh "$IMAGE" -c \
    'grep -q "$(sed -n 2p /usr/local/share/ca-certificates/build-ca.crt)" /etc/ssl/certs/ca-certificates.crt' \
    >"$WORK/ca.log" 2>&1; then
  pass "build: CA_CERT is in the image's trust store"
else
  fail "build: CA_CERT is in the image's trust store ($(tail -3 "$WORK/ca.log"))"
fi

# ------------------------------------------------------------------ 5. the checks
RUN=(docker run --network none --label "$LABEL" -e OMP_NUM_THREADS=1)
SMALL=(+experiment=smoke trainer.max_steps=3)

# run NAME ARGS...: `timeout docker run ...` with its output in $WORK/NAME.log; returns its status
run() {
  local name="$1"
  shift
  timeout "$RUN_TIMEOUT" "${RUN[@]}" --rm "$@" >"$WORK/$name.log" 2>&1
}
show() { # the log's error lines, then its tail
  { grep -E 'Error|error:|refus' "$WORK/$1.log" | head -10; echo '    ...'; tail -"${2:-25}" "$WORK/$1.log"; } | sed 's/^/    | /' >&2
}
no_hydra_folder() { # defect 8: nothing but run directories in the outputs folder
  local stray
  stray="$(find "$1" -mindepth 1 -maxdepth 1 -name '20[0-9][0-9]-*' -print -quit)"
  [[ -z "$stray" ]] || { echo "stray Hydra folder $stray"; return 1; }
}

# --help
if run help "$IMAGE" --help && grep -q "moco_retrieval.train" "$WORK/help.log"; then
  pass "--help (exit 0)"
else
  show help
  fail "--help"
fi

# docker/run.sh on a machine without a GPU (it passed --gpus all unconditionally: exit 125)
mkdir -p "$WORK/runsh"
if (cd "$WORK/runsh" && IMAGE="$IMAGE" DOCKER_RUN_ARGS="--network none --label $LABEL" timeout "$RUN_TIMEOUT" \
    "$ROOT/docker/run.sh" --help >"$WORK/runsh.log" 2>&1) && grep -q "moco_retrieval.train" "$WORK/runsh.log"; then
  pass "docker/run.sh --help without a GPU (exit 0)"
else
  show runsh
  fail "docker/run.sh --help without a GPU"
fi

# A 3-step smoke run, the Debian lists mounted read-only, as the README's "one machine" section
# has it: the host user (uid 1234 here) makes data/ and outputs/, the container runs as that user.
host_uid=1234
mkdir -p "$WORK/host"
chown "$host_uid:$host_uid" "$WORK/host"
setpriv --reuid="$host_uid" --regid="$host_uid" --clear-groups sh -c "cd '$WORK/host' && mkdir -p data outputs"
if [[ ! -d "$SMOKE_DEBIAN_DIR" ]]; then
  fail "smoke run, data mounted read-only: no Debian lists at $SMOKE_DEBIAN_DIR"
elif run mounted --user "$host_uid:$host_uid" -v "$WORK/host/data:/data" -v "$WORK/host/outputs:/workspace/outputs" \
    -v "$(cd "$SMOKE_DEBIAN_DIR" && pwd):/srv/debian-bookworm:ro" \
    "$IMAGE" "${SMALL[@]}" data.debian_dir=/srv/debian-bookworm run_dir=/workspace/outputs/mounted; then
  d="$WORK/host/outputs/mounted"
  why=""
  [[ -f "$d/metrics.json" && -f "$d/checkpoints/last.ckpt" ]] || why="no metrics.json or last.ckpt in $d"
  [[ -z "$why" && "$(stat -c %u "$d/metrics.json")" == "$host_uid" ]] || why="${why:-metrics.json not owned by uid $host_uid}"
  grep -q "built the Debian data set from data.debian_dir=/srv/debian-bookworm" "$WORK/mounted.log" \
    || why="${why:-the set was not built from the mounted lists}"
  [[ -z "$why" ]] && why="$(no_hydra_folder "$WORK/host/outputs")"
  if [[ -z "$why" ]]; then
    pass "3-step smoke run, Debian lists mounted read-only, README's one-machine steps as uid $host_uid"
  else
    show mounted
    fail "3-step smoke run, data mounted read-only: $why"
  fi
else
  show mounted
  fail "3-step smoke run, data mounted read-only (exit $?)"
fi

# The same with the data built into the image, as an arbitrary uid without an /etc/passwd entry
# and without a /data mount (the pair store then goes into the image's /data/cache).
any_uid=4242
mkdir -p "$WORK/builtin"
chown "$any_uid:$any_uid" "$WORK/builtin"
if run builtin --user "$any_uid:$any_uid" -v "$WORK/builtin:/workspace/outputs" \
    "$IMAGE" "${SMALL[@]}" run_dir=/workspace/outputs/builtin; then
  d="$WORK/builtin/builtin"
  why=""
  [[ -f "$d/metrics.json" && -f "$d/checkpoints/last.ckpt" ]] || why="no metrics.json or last.ckpt in $d"
  # the image's own set, as built: read from /data/cache, not built again
  if ! grep -q "converting /data/cache/debian-" "$WORK/builtin.log" || grep -q "built the Debian data set" "$WORK/builtin.log"; then
    why="${why:-not the data set built into the image}"
  fi
  [[ -z "$why" ]] && why="$(no_hydra_folder "$WORK/builtin")"
  if [[ -z "$why" ]]; then
    pass "3-step smoke run, data built into the image, as uid $any_uid"
  else
    show builtin
    fail "3-step smoke run, data built into the image, as uid $any_uid: $why"
  fi
else
  show builtin
  fail "3-step smoke run, data built into the image, as uid $any_uid (exit $?)"
fi

# docker stop mid-run -> 143, last.ckpt, the printed resume command; that command then finishes.
# stop_and_resume NAME EXPECTED_STATUS DOCKER_OPTIONS... -- OVERRIDES...
stop_and_resume() {
  local name="$1" expected="$2" opts=() args=() out="$WORK/$1" cid status step line resume=()
  shift 2
  while [[ $# -gt 0 && "$1" != -- ]]; do
    opts+=("$1")
    shift
  done
  shift
  args=("$@")
  mkdir -p "$out"
  chown "$any_uid:$any_uid" "$out"
  cid="$("${RUN[@]}" -d --user "$any_uid:$any_uid" -v "$out:/workspace/outputs" "${opts[@]}" "$IMAGE" \
    "${args[@]}" run_dir=/workspace/outputs/run)"
  step=""
  for _ in $(seq $((RUN_TIMEOUT * 5))); do
    step="$(docker logs "$cid" 2>&1 | sed -n 's/.*\bstep \([0-9]\+\)\/[0-9]\+.*/\1/p' | tail -1)"
    [[ -n "$step" && "$step" -ge 2 ]] && break
    [[ "$(docker inspect --format '{{.State.Running}}' "$cid")" == true ]] || break
    sleep 0.2
  done
  docker stop -t 120 "$cid" >/dev/null
  status="$(docker wait "$cid")"
  docker logs "$cid" >"$WORK/$name-stop.log" 2>&1
  docker rm "$cid" >/dev/null
  line="$(grep -o 'to resume this run: .*' "$WORK/$name-stop.log" | tail -1)"
  local why="" stopped
  # the trainer's own line (rank 0's under torchrun): "stopped by SIGTERM after step N; checkpoint ...; exit status 143"
  stopped="$(sed -n 's/.*stopped by SIGTERM after step \([0-9]\+\);.*exit status 143.*/\1/p' "$WORK/$name-stop.log" | tail -1)"
  [[ -n "$step" && "$step" -ge 2 ]] || why="no progress line seen before the stop"
  [[ "$status" == "$expected" ]] || why="${why:-exit $status, expected $expected}"
  [[ -n "$stopped" ]] || why="${why:-no 'stopped by SIGTERM after step N; ...; exit status 143' line}"
  [[ -f "$out/run/checkpoints/last.ckpt" ]] || why="${why:-no checkpoints/last.ckpt}"
  [[ ! -f "$out/run/metrics.json" ]] || why="${why:-metrics.json written: the run was not stopped mid-run}"
  [[ -n "$line" && "$line" == *ckpt_path=last* ]] || why="${why:-no printed resume command with ckpt_path=last}"
  if [[ -n "$why" ]]; then
    tail -25 "$WORK/$name-stop.log" | sed 's/^/    | /' >&2
    fail "$name: docker stop mid-run: $why"
    return
  fi
  pass "$name: docker stop -> stopped after step $stopped, exit $status, last.ckpt, printed: ${line#to resume this run: }"
  # the printed command's overrides, split as a shell would (no eval)
  line="${line#to resume this run: }"
  line="${line#python -m moco_retrieval.train }"
  line="${line#the same torchrun launch with the arguments }"
  mapfile -d '' -t resume < <(python3 -c 'import shlex, sys; sys.stdout.write("\0".join(shlex.split(sys.argv[1])) + "\0")' "$line")
  if run "$name-resume" --user "$any_uid:$any_uid" -v "$out:/workspace/outputs" "${opts[@]}" "$IMAGE" "${resume[@]}" \
      && [[ -f "$out/run/metrics.json" ]] && grep -q "Restoring states from the checkpoint path" "$WORK/$name-resume.log"; then
    why="$(no_hydra_folder "$out")"
    if [[ -z "$why" ]]; then
      pass "$name: the printed resume command finished from last.ckpt (metrics.json)"
    else
      fail "$name: resume: $why"
    fi
  else
    show "$name-resume"
    fail "$name: the printed resume command (exit or files)"
  fi
}

# 100 steps (a few a second here): room to stop the run well before its end, after step 2
LONG=(+experiment=smoke data.max_train_examples=3200 trainer.max_steps=100 trainer.log_every_n_steps=1
  trainer.val_check_interval=50)
stop_and_resume single 143 -- "${LONG[@]}"
# torchrun: the workers stop with status 143 and torchrun itself exits 1 (moco_retrieval/training/preemption.py)
stop_and_resume torchrun 1 -e NPROC_PER_NODE=2 -e TORCH_ELASTIC_SHUTDOWN_TIMEOUT=100 -- \
  "${LONG[@]}" trainer=ddp trainer.accelerator=cpu
