"""The object-storage claim store (``runner.core.claims.ObjectClaimStore``) rule by rule, on moto's S3 server on the
loopback (``runner.core.testing.s3_server``, as ``tests/test_storage.py`` uses it): where its keys are, the nonce of
a create, a create whose answer was lost (settled by reading the object back), the ETag a renewal is conditional on,
and each request's failure named with the claim object's URL. A failure is injected by wrapping the real s3fs
filesystem (the request runs, or not, and then its answer is replaced by an error)."""

from __future__ import annotations

import pytest

from _helpers import requires_extra, s3_environment

pytestmark = [pytest.mark.cpu, requires_extra("storage", "s3-server")]

BUCKET = "claimrules"


@pytest.fixture(scope="module")
def s3():
    with s3_environment(BUCKET) as env:
        yield env


class Faulty:
    """The store's real filesystem, with ``fail[method]`` = ``(before, error)``: the call raises ``error``, after
    running the real request unless ``before`` (an answer lost after the write, or a request refused)."""

    def __init__(self, fs) -> None:
        self.fs, self.fail, self.calls = fs, {}, []

    def __getattr__(self, name):
        real = getattr(self.fs, name)
        if name not in ("pipe_file", "cat_file", "info", "exists"):
            return real

        def call(*a, **kw):
            self.calls.append((name, a, kw))
            if name in self.fail:
                before, err = self.fail[name]
                if not before:
                    real(*a, **kw)
                raise err
            return real(*a, **kw)
        return call


def _store(url):
    from runner.core.claims import ObjectClaimStore

    st = ObjectClaimStore(url)
    st.fs = Faulty(st.fs)
    return st


def test_object_store_keys_lie_under_the_runs_claims_namespace(s3):
    from runner.core.claims import object_store

    st = object_store(f"s3://{BUCKET}/runX/", "tokX")  # only the trailing "/" is stripped
    assert st.url == f"s3://{BUCKET}/runX/claims/tokX" and st.where() == st.url and st.name == "object"
    assert st.create("b0000001.g0", {"beat": 0})
    doc = st.get("b0000001.g0")
    assert set(doc) == {"beat", "nonce"} and len(doc["nonce"]) == 16 and int(doc["nonce"], 16) >= 0
    assert st.fs.cat_file(f"{BUCKET}/runX/claims/tokX/b0000001.g0").endswith(b"\n")
    from runner.core.claims import ObjectClaimStore

    assert ObjectClaimStore(f"s3://{BUCKET}/runX/claims/tokX//").url == st.url


def test_an_unknown_scheme_is_refused_naming_the_claims_store():
    from runner.core.claims import ObjectClaimStore

    with pytest.raises(Exception, match=r"^claims store='zz://b/x': no filesystem is known for zz://"):
        ObjectClaimStore("zz://b/x")


def test_a_create_whose_answer_was_lost_is_settled_by_reading_the_object_back(s3):
    from runner.core.errors import StorageError

    url = f"s3://{BUCKET}/lost"
    holder, other = _store(url), _store(url)
    holder.fs.fail["pipe_file"] = (False, OSError("connection reset"))  # written, answer lost
    assert holder.create("b0000001.g0", {"beat": 0}) is True
    assert holder.etags["b0000001.g0"] == holder.fs.fs.info(f"{BUCKET}/lost/b0000001.g0")["ETag"]
    other.fs.fail["pipe_file"] = (True, OSError("connection reset"))  # not written; the object is holder's
    assert other.create("b0000001.g0", {"beat": 9}) is False and "b0000001.g0" not in other.etags
    del holder.fs.fail["pipe_file"]
    del other.fs.fail["pipe_file"]
    holder.put("b0000001.g0", {"beat": 1})  # renewals: each conditional on the ETag of the one before
    holder.put("b0000001.g0", {"beat": 2})
    assert holder.etags["b0000001.g0"] == holder.fs.fs.info(f"{BUCKET}/lost/b0000001.g0")["ETag"]
    other.put("b0000001.g0", {"beat": 7})  # another writer overwrites it
    with pytest.raises(StorageError, match="overwritten by another writer"):  # conditional on the recovered ETag
        holder.put("b0000001.g0", {"beat": 1})


def test_each_failed_request_is_named_with_the_claim_objects_url(s3):
    from runner.core.errors import StorageError

    url = f"s3://{BUCKET}/fail"
    st = _store(url)
    st.fs.fail["pipe_file"] = (True, OSError("connection reset"))  # not written: nothing to read back
    with pytest.raises(StorageError) as e:
        st.create("k.g0", {})
    assert str(e.value).startswith(f"creating claim object {url}/k.g0 failed (OSError: connection reset)")
    st.fs.fail["cat_file"] = (True, PermissionError("denied"))  # and reading it back fails too
    with pytest.raises(StorageError) as e:
        st.create("k.g0", {})
    assert str(e.value).startswith(f"creating claim object {url}/k.g0 failed (PermissionError: denied)")
    with pytest.raises(StorageError) as e:
        st.put("k.g0", {})
    assert str(e.value).startswith(f"writing claim object {url}/k.g0 failed (OSError: connection reset)")
    with pytest.raises(StorageError) as e:
        st.get("k.g0")
    assert str(e.value).startswith(f"reading claim object {url}/k.g0 failed (PermissionError: denied)")
    st.fs.fail["exists"] = (True, OSError("timed out"))
    with pytest.raises(StorageError) as e:
        st.exists("k.g0")
    assert str(e.value).startswith(f"looking up claim object {url}/k.g0 failed (OSError: timed out)")


def test_a_put_without_an_etag_in_its_answer_is_followed_by_an_unconditional_one(s3):
    url = f"s3://{BUCKET}/noetag"
    holder, other = _store(url), _store(url)
    assert holder.create("k", {"beat": 0}) and holder.etags["k"]
    real = holder.fs.fs.pipe_file
    holder.fs = Faulty(holder.fs.fs)
    holder.fs.pipe_file = lambda *a, **kw: (real(*a, **kw), None)[1]  # answered without an ETag
    holder.put("k", {"beat": 1})
    assert "k" not in holder.etags
    other.put("k", {"beat": 5})
    holder.put("k", {"beat": 2})  # nothing to be conditional on: written
    assert other.get("k") == {"beat": 2}
    assert holder.get("absent") is None and not holder.exists("absent") and holder.exists("k")


def test_a_failed_conditional_put_is_told_from_other_failures(s3):
    import errno

    from runner.core.errors import StorageError

    url = f"s3://{BUCKET}/precond"
    st = _store(url)
    st.fs.fail["pipe_file"] = (True, OSError("HTTP 412 Precondition Failed"))
    with pytest.raises(StorageError) as e:  # no ETag of its own: not a lost race, a failed write
        st.put("fresh", {})
    assert str(e.value).startswith(f"writing claim object {url}/fresh failed (OSError: HTTP 412")
    del st.fs.fail["pipe_file"]
    assert st.create("k", {"beat": 0}) and st.etags["k"]
    for err in (OSError("An error occurred (PreconditionFailed) when calling the PutObject operation"),
                OSError("status 412"), OSError(errno.EINVAL, "Invalid argument")):
        st.fs.fail["pipe_file"] = (True, err)
        with pytest.raises(StorageError) as e:
            st.put("k", {"beat": 1})
        assert str(e.value).startswith(f"claim object {url}/k was overwritten by another writer since this worker "
                                       "wrote it (If-Match failed); it is not overwritten back"), (err, e.value)
    st.fs.fail["pipe_file"] = (True, OSError("connection reset"))
    with pytest.raises(StorageError) as e:
        st.put("k", {"beat": 1})
    assert str(e.value).startswith(f"writing claim object {url}/k failed (OSError: connection reset)")


def test_an_object_that_is_not_a_document_reads_as_one_being_written(s3):
    url = f"s3://{BUCKET}/notdoc"
    st = _store(url)
    st.fs.fs.pipe_file(f"{BUCKET}/notdoc/list", b"[1, 2]\n")
    st.fs.fs.pipe_file(f"{BUCKET}/notdoc/partial", b'{"beat": ')
    st.fs.fs.pipe_file(f"{BUCKET}/notdoc/bytes", b"\xff\xfe")
    assert st.get("list") == {} and st.get("partial") == {} and st.get("bytes") == {}
