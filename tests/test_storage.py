"""Object storage (``runner.core.storage``): a run reads its rows from and writes its artifacts to an S3-compatible
server the tests start on the loopback (moto's server mode, real HTTP, s3fs as the client: nothing is mocked), and
every record at the URL names an object that exists with the recorded sha256. A resume from a fresh staging dir
reuses what the URL holds and regenerates exactly the objects that are missing or altered; ``runner.repro`` of the
URL reproduces byte for byte; a process SIGKILLed between a temp object's upload and its publication leaves no
record naming the object (and no object under its final key); claims on the server from two processes never
claim a batch twice (``If-None-Match: *``), and a renewal whose claim another writer overwrote fails (``If-Match``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from _helpers import requires_extra, run_module, s3_environment

pytestmark = [pytest.mark.cpu, requires_extra("storage", "s3-server")]

BUCKET = "runs"
PROMPTS = ["a red circle in the top left on a white background", "a blue square in the center on a white background",
           "a green triangle in the bottom right on a white background", "a red square in the top right on a white "
           "background", "a blue circle in the bottom left on a white background"]
ARGS = ["platform=cpu", "cpu_threads=1", "model.generation.num_inference_steps=4", "dataset=jsonl"]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on the loopback with the clients' environment set (``_helpers.s3_environment``). Yields that
    environment."""
    with s3_environment(BUCKET) as env:
        yield env


def test_a_second_server_of_the_process_starts_without_the_first_ones_buckets():
    """Regression: moto's backends are per process, so a server started after another (the module fixture set up
    twice in one session, as a selection of this file's tests interleaved with others' does) held the first one's
    bucket and the fixture's mkdir failed with FileExistsError. In its own process: a new server empties moto's
    backends, which would take the bucket of this module's fixture with it."""
    code = """
import os, s3fs
from runner.core.testing import s3_server
os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
for _ in range(2):
    server = s3_server()
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    print(sorted(fs.ls("")))
    fs.mkdir("runs")
    fs.pipe_file("runs/x", b"1")
    server.stop()
"""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "[]"]


def _fs():
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def _rows_url(prefix: str) -> str:
    rows = b"".join(json.dumps({"id": f"r{i}", "prompt": p}).encode() + b"\n" for i, p in enumerate(PROMPTS))
    _fs().pipe_file(f"{BUCKET}/{prefix}/rows.jsonl", rows)
    return f"s3://{BUCKET}/{prefix}/rows.jsonl"


def _run(stage: Path, url: str, rows: str, env_extra: Dict[str, str] = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "runner", *ARGS, f"dataset.path={rows}", f"output.dir={url}",
           f"hydra.run.dir={stage}"]
    return subprocess.Popen(cmd, cwd=stage.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, **kw)


def _finish(p: subprocess.Popen, timeout: int = 300) -> None:
    _, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]


def _remote_records(url: str) -> List[Dict]:
    """The ok records of the journal at ``url``, each checked: its object exists with the recorded sha256."""
    fs, root = _fs(), url[len("s3://"):]
    records = [json.loads(x) for x in fs.cat_file(f"{root}/items.jsonl").decode().splitlines() if x.strip()]
    for r in records:
        assert r["status"] == "ok"
        data = fs.cat_file(f"{root}/{r['file']}")  # raises FileNotFoundError when a record names no object
        assert hashlib.sha256(data).hexdigest() == r["file_sha256"], r["file"]
    return records


def _temp_objects(url: str) -> List[str]:
    fs, root = _fs(), url[len("s3://"):]
    return [p for p in fs.find(root) if "/." in p]


def test_a_run_on_s3_reproduces_and_resumes_from_what_the_url_holds(s3, tmp_path):
    url, rows = f"s3://{BUCKET}/resume", _rows_url("resume-data")
    _finish(_run(tmp_path / "stage1", url, rows))
    records = _remote_records(url)
    assert [r["id"] for r in records] == [f"r{i}" for i in range(len(PROMPTS))]
    fs = _fs()
    m = json.loads(fs.cat_file(f"{BUCKET}/resume/manifest.json"))
    assert m["status"] == "completed" and m["storage"]["url"] == url
    assert m["dataset"]["path"] == rows  # the URL is recorded, with the sha256 of the object's bytes
    assert m["dataset"]["sha256"] == hashlib.sha256(fs.cat_file(rows[len("s3://"):])).hexdigest()
    assert _temp_objects(url) == []
    # runner.repro of the URL: pulled (every object checked against its record), re-run, equal bytes
    r = run_module("runner.repro", [url, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    check = json.loads((tmp_path / "rerun" / "repro_check.json").read_text())
    assert check["ok"] and check["mode"] == "bytes" and check["original"] == url
    assert sorted(i["key"] for i in check["items"]) == [f"r{i}" for i in range(len(PROMPTS))]
    # one object gone, one altered behind the run's back: a resume from a fresh staging dir regenerates exactly those
    fs.rm_file(f"{BUCKET}/resume/images/r1.png")
    fs.pipe_file(f"{BUCKET}/resume/images/r3.png", b"not the image the record names")
    _finish(_run(tmp_path / "stage2", url, rows))
    m2 = json.loads(fs.cat_file(f"{BUCKET}/resume/manifest.json"))
    assert m2["storage"]["pulled"]["objects_missing"] == 2 and m2["storage"]["pulled"]["objects"] == 3
    assert m2["counts"]["reused"] == 3 and m2["counts"]["ok"] == 2
    assert {r["id"]: r["file_sha256"] for r in _remote_records(url)} == {r["id"]: r["file_sha256"] for r in records}


def test_a_write_killed_mid_object_leaves_no_record_claiming_it(s3, tmp_path):
    url, rows = f"s3://{BUCKET}/killed", _rows_url("killed-data")
    marker = tmp_path / "paused"
    p = _run(tmp_path / "stage1", url, rows, {"RUNNER_TEST_PUBLISH_PAUSE": str(marker)})
    deadline = time.time() + 240
    while not marker.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), p.communicate(timeout=60)[1][-3000:]
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)  # between the temp object's upload and its publication
    p.communicate(timeout=60)
    rel = marker.read_text()
    fs, root = _fs(), f"{BUCKET}/killed"
    temps = _temp_objects(url)
    assert any(t.startswith(f"{root}/{rel.rsplit('/', 1)[0]}/.{rel.rsplit('/', 1)[1]}.tmp") for t in temps), temps
    assert not fs.exists(f"{root}/{rel}")  # never visible under its final name
    stage_records = [json.loads(x) for x in (tmp_path / "stage1" / "items.jsonl").read_text().splitlines()]
    assert all(r["file"] != rel for r in stage_records)  # not even in the staging dir's journal
    if fs.exists(f"{root}/items.jsonl"):
        assert all(r["file"] != rel for r in _remote_records(url))
    _finish(_run(tmp_path / "stage2", url, rows))  # the same command, resumed from the URL
    m = json.loads(fs.cat_file(f"{root}/manifest.json"))
    assert m["status"] == "completed" and m["storage"]["pulled"]["temp_removed"] >= 1
    assert _temp_objects(url) == []
    assert sorted(r["id"] for r in _remote_records(url)) == [f"r{i}" for i in range(len(PROMPTS))]


# ------------------------------------------------------------------------------------------- claims on S3
def _claim_all(url: str, n: int, env: Dict[str, str], out: "mp.Queue") -> None:
    os.environ.update(env)
    from runner.core.claims import Claims, ObjectClaimStore, batch_id

    c = Claims(ObjectClaimStore(url), lease_s=60, poll_s=0.05)
    c.register()
    ids = [batch_id(i) for i in range(n)]
    got = []
    for b in c.pull(ids, ids, stop=lambda: False):
        got.append(b)
        c.complete(b)
    out.put((os.getpid(), got))


def test_claims_on_s3_from_two_processes_never_claim_a_batch_twice(s3):
    from runner.core.claims import ObjectClaimStore, batch_id

    n, url = 12, f"s3://{BUCKET}/claims/race"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_claim_all, args=(url, n, s3, q)) for _ in range(2)]
    for p in ps:
        p.start()
    got = [q.get(timeout=240) for _ in ps]
    for p in ps:
        p.join(timeout=60)
    flat = [b for _, g in got for b in g]
    assert sorted(flat) == [batch_id(i) for i in range(n)]  # every batch once, none twice
    store = ObjectClaimStore(url)
    for pid, batches in got:
        for b in batches:  # the claim object names its claimer, and no one took it over
            assert store.get(f"{b}.g0")["pid"] == pid and store.get(f"{b}.g1") is None and store.exists(f"{b}.done")
    assert sorted(d["rank"] for d in (store.get("workers/0.json"), store.get("workers/1.json"))) == [0, 1]


def test_object_claim_store_creates_exclusively_and_renews_only_its_own_claim(s3):
    from runner.core.claims import ObjectClaimStore
    from runner.core.errors import StorageError

    url = f"s3://{BUCKET}/claims/unit"
    holder, other = ObjectClaimStore(url), ObjectClaimStore(url)
    assert holder.create("b0000000.g0", {"beat": 0}) and not other.create("b0000000.g0", {"beat": 9})
    assert holder.get("b0000000.g0")["beat"] == 0 and holder.get("b0000001.g0") is None
    holder.put("b0000000.g0", {"beat": 1})  # a renewal: conditional on the ETag the holder wrote
    assert other.get("b0000000.g0") == {"beat": 1}
    other.put("b0000000.g0", {"beat": 7, "pid": "someone else"})  # another writer overwrites it
    with pytest.raises(StorageError, match="overwritten by another writer"):
        holder.put("b0000000.g0", {"beat": 2})
    assert holder.get("b0000000.g0")["beat"] == 7  # not clobbered back


def _no_credentials(monkeypatch) -> None:
    """The test server's endpoint, but none of the AWS_* credential variables (and no credentials file)."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("where", ["output.dir", "dataset.path"])
def test_object_storage_without_credentials_is_refused_at_startup_naming_the_url(s3, tmp_path, monkeypatch, where):
    """No credentials for an s3:// dataset.path or output.dir: exit 2 at startup naming the key, the URL and the
    AWS_* variables of the fix; no traceback (was botocore's NoCredentialsError, 165 lines, exit 1)."""
    rows = _rows_url("nocreds")
    _no_credentials(monkeypatch)
    out = f"s3://{BUCKET}/nocreds-run" if where == "output.dir" else tmp_path / "run"
    url = rows if where == "dataset.path" else out
    p = run_module("runner", [*ARGS, "dataset.limit=1", f"dataset.path={rows}", f"output.dir={out}",
                              f"hydra.run.dir={tmp_path / 'stage'}"], cwd=tmp_path)
    err = p.stdout + p.stderr
    assert p.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "NoCredentialsError" in err, err[-3000:]
    line = next(x for x in err.splitlines() if "StorageAccessError" in x)
    assert f"{where}={str(url)!r}" in line and "AWS_ACCESS_KEY_ID" in line and "fix:" in line, line


def test_an_output_dir_in_a_missing_bucket_is_refused_at_startup(s3, tmp_path):
    """A bucket the endpoint does not have: refused before anything runs (was: the first upload failed, exit 1)."""
    p = run_module("runner", [*ARGS, "dataset.limit=1", f"dataset.path={_rows_url('nobucket')}",
                              "output.dir=s3://no-such-bucket/run", f"hydra.run.dir={tmp_path / 'stage'}"], cwd=tmp_path)
    err = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "output.dir='s3://no-such-bucket/run'" in err and "'no-such-bucket' does not exist" in err, err[-3000:]
    assert not (tmp_path / "stage" / "items.jsonl").exists()


def test_a_claims_store_without_credentials_is_refused_when_opened(s3, monkeypatch):
    """The claims store is an entry point too: opening it without credentials, or on a missing bucket, refuses
    naming the URL and the fix (a StorageAccessError, exit 2) instead of failing the first claim."""
    from runner.core.claims import ObjectClaimStore
    from runner.core.storage import StorageAccessError

    with pytest.raises(StorageAccessError, match="no-such-bucket' does not exist"):
        ObjectClaimStore("s3://no-such-bucket/claims/t")
    _no_credentials(monkeypatch)
    with pytest.raises(StorageAccessError) as e:
        ObjectClaimStore(f"s3://{BUCKET}/claims/nocreds")
    assert e.value.exit_code == 2 and f"claims store='s3://{BUCKET}/claims/nocreds'" in str(e.value)
    assert "no usable credentials" in str(e.value) and "AWS_SECRET_ACCESS_KEY" in str(e.value)
