"""localrun.datafiles.file_identity: what the measurement caches key a model by."""

from __future__ import annotations

from localrun.datafiles import IDENTITY_SPAN, file_identity


def test_the_identity_follows_the_bytes_not_the_path(tmp_path):
    body = bytes(range(256)) * (3 * IDENTITY_SPAN // 256)  # longer than both hashed ends
    a, b = tmp_path / "a.gguf", tmp_path / "sub" / "b.gguf"
    b.parent.mkdir()
    a.write_bytes(body)
    b.write_bytes(body)
    assert file_identity(a) == file_identity(b) is not None
    head = bytearray(body)
    head[10] ^= 1  # the header: another quantization or model
    b.write_bytes(bytes(head))
    assert file_identity(b) != file_identity(a)
    tail = bytearray(body)
    tail[-1] ^= 1
    b.write_bytes(bytes(tail))
    assert file_identity(b) != file_identity(a)
    b.write_bytes(body + b"x")  # another size
    assert file_identity(b) != file_identity(a)
    assert file_identity(tmp_path / "missing.gguf") is None


def test_a_model_folder_is_identified_by_its_files(tmp_path):
    def folder(name, weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(weights)
        return d

    one, same, other = folder("one", b"w" * 100), folder("same", b"w" * 100), folder("other", b"v" * 100)
    assert file_identity(one) == file_identity(same) != file_identity(other)
    (same / "extra.json").write_text("{}")
    assert file_identity(same) != file_identity(one)
