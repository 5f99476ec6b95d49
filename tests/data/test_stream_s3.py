"""Streaming from an S3-compatible endpoint (data.stream_dir=s3://...): moto's S3 on localhost, over
https with a CA of the test's own (litdata's obstore client refuses plain http; stream.check_store),
reached through the standard AWS variables. Prepared by the command, the chunks stream the batches of
a local folder's; a plain-http endpoint, and one stopped before or during the read, are one message
naming the URL. Run the slow one with -m slow."""
from __future__ import annotations

import datetime
import ipaddress
import re
import threading
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("litdata", reason="data.stream needs litdata (pip install --no-deps -r requirements-nodeps.txt)")
pytest.importorskip("moto", reason="the S3 endpoint is moto's (pip install 'moto[server]')")

from moco_retrieval.data import stream  # noqa: E402
from moco_retrieval.data.formats import DataError  # noqa: E402
from tests.data.test_stream import epoch, module, streamed  # noqa: E402
from tests.helpers import make_cfg  # noqa: E402


def write_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A CA's certificate, and a certificate for 127.0.0.1 that it signed with its key: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def sign(subject: str, public: object, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name("test ca")).public_key(public)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:  # (rustls, obstore's TLS, refuses a CA's certificate as the server's own)
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(ca_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(sign("test ca", ca_key.public_key(), True).public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(sign("127.0.0.1", key.public_key(), False).public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class Endpoint:
    """moto's S3 served over https on a free localhost port, in a thread of this process."""

    def __init__(self, folder: Path):
        from moto.moto_server.threaded_moto_server import MotoRequestHandler
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        folder.mkdir(parents=True, exist_ok=True)
        self.ca, cert, key = write_tls(folder)
        self.server = make_server("127.0.0.1", 0, DomainDispatcherApplication(create_backend_app), threaded=True,
                                  request_handler=MotoRequestHandler, ssl_context=(str(cert), str(key)))
        self.url = f"https://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # connections refused from here on


@pytest.fixture
def s3(tmp_path, monkeypatch):
    """An endpoint and an empty bucket of its own (moto's buckets outlive a server in this process),
    named through the AWS variables a user sets: ``s3://BUCKET``."""
    import boto3

    endpoint = Endpoint(tmp_path / "tls")
    for k, v in {"AWS_ENDPOINT_URL": endpoint.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_CA_BUNDLE": str(endpoint.ca),  # boto3's trust
                 "SSL_CERT_FILE": str(endpoint.ca),  # obstore's
                 "DATA_OPTIMIZER_CACHE_FOLDER": str(tmp_path / "optimize-cache")}.items():  # litdata's staging
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    endpoint.bucket = f"moco-{uuid.uuid4().hex[:12]}"
    endpoint.client = boto3.client("s3")
    endpoint.client.create_bucket(Bucket=endpoint.bucket)
    yield endpoint
    endpoint.stop()


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(stream, "CHUNK_BYTES", 400)


def keys(s3, prefix: str) -> dict[str, int]:
    pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return {o["Key"][len(prefix):]: o["Size"] for page in pages for o in page.get("Contents", [])}


def prepare(cfg, where: str, capsys) -> None:
    from moco_retrieval.data.__main__ import main

    assert main(["prepare", "data=jsonl", f"data.train_path={cfg.train_path}", "data.stream=true",
                 f"data.stream_dir={where}", "workers=2"]) == 0
    rows = len(Path(cfg.train_path).read_text().splitlines())
    assert f"stream {where}: {rows} rows of data" in capsys.readouterr().out


@pytest.mark.slow  # ~30 s on a busy 2-core machine: two preparations, eight readings
def test_prepared_on_s3_it_streams_the_batches_of_a_folder(s3, tmp_path, capsys):
    url = f"s3://{s3.bucket}/runs/chunks"
    cfg = make_cfg(tmp_path, n=40, repeat_ids=True, batch_size=4)
    prepare(cfg, url, capsys)
    objects = keys(s3, "runs/chunks/")
    chunks = [k for k in objects if re.fullmatch(r"data/chunk-\d+-\d+\.bin", k)]
    assert {stream.MANIFEST, "data/index.json"} <= set(objects) and len(chunks) > 2
    prepare(cfg, str(tmp_path / "local"), capsys)
    remote, local = streamed(cfg, url), streamed(make_cfg(tmp_path, n=40, repeat_ids=True, batch_size=4),
                                                 tmp_path / "local")
    rows = epoch(module(local), 0)
    assert epoch(module(remote), 0) == rows and epoch(module(remote), 1, 3) == epoch(module(local), 1, 3)
    assert sorted(i for b in rows for i in b) == list(range(40))
    s3.client.delete_object(Bucket=s3.bucket, Key=f"runs/chunks/{chunks[1]}")  # lost from the store
    with pytest.raises(DataError, match=re.escape(f"{url}/{chunks[1]}: a chunk of the stream is missing")):
        module(remote)


def test_a_plain_http_endpoint_is_refused_before_anything_is_written(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url.replace("https://", "http://"))
    url = f"s3://{s3.bucket}/chunks"
    with pytest.raises(DataError, match=re.escape(f"data.stream_dir={url}: its endpoint "
                                                  f"{s3.url.replace('https://', 'http://')} (AWS_ENDPOINT_URL")):
        module(streamed(make_cfg(tmp_path, n=12), url))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    assert keys(s3, "") == {}


@pytest.mark.slow  # ~15 s: litdata's reader threads time out against a stopped server
def test_an_endpoint_stopped_before_or_during_the_read_is_one_message(s3, tmp_path, capsys):
    url = f"s3://{s3.bucket}/chunks"
    cfg = streamed(make_cfg(tmp_path, n=200, batch_size=4), url)
    prepare(cfg, url, capsys)
    dm = module(cfg)
    batches = iter(dm.train_dataloader())
    next(batches)
    s3.stop()  # mid-epoch: most chunks not yet downloaded
    t0 = time.monotonic()
    with pytest.raises(DataError, match=re.escape(f"{url}: cannot read the stream's chunks")) as e:
        list(batches)
    assert "its object store out of reach (check the endpoint and credentials)" in str(e.value)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
    t1 = time.monotonic()
    with pytest.raises(DataError, match=re.escape(f"{url}/{stream.MANIFEST}: cannot reach the stream's manifest")):
        module(cfg)  # stopped before the run: said as it opens the stream, before the model loads
    t2 = time.monotonic()
    assert t1 - t0 < 60 and t2 - t1 < 60, (t1 - t0, t2 - t1)


@pytest.mark.slow  # two training runs of the tiny model (~1 min on a busy 2-core machine)
def test_the_tiny_model_trains_from_s3_on_the_rows_of_a_folder(s3, cli_env, tmp_path):
    """`python -m moco_retrieval.train` with data.stream_dir=s3://... (chunks prepared by the run
    itself): 3 steps whose queued document ids are the local folder's run's, step by step."""
    import os
    import subprocess
    import sys

    import torch

    env = {**cli_env, **{k: v for k, v in os.environ.items() if k.startswith(("AWS_", "SSL_", "DATA_OPTIMIZER"))}}
    queues = {}
    for name, where in (("s3", f"s3://{s3.bucket}/chunks"), ("local", str(tmp_path / "chunks"))):
        cmd = [sys.executable, "-m", "moco_retrieval.train", "+experiment=smoke", "logger=none", "data.stream=true",
               f"data.stream_dir={where}", "trainer.max_steps=3", f"run_dir={tmp_path / name}",
               f"hydra.run.dir={tmp_path / 'hydra'}"]
        run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        ckpt = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
        assert ckpt["global_step"] == 3
        queues[name] = ckpt["state_dict"]["objective.docs.queue.queue_ids"]
    assert any(k.startswith("chunks/data/chunk-") for k in keys(s3, ""))
    assert torch.equal(queues["s3"], queues["local"]) and len(set(queues["s3"][:48].tolist())) > 16
