"""The committed stubs are what `python -m protos.generate` produces from the .proto files."""

from protos.generate import stale_files


def test_committed_stubs_are_fresh() -> None:
    assert stale_files() == [], "run `python -m protos.generate` and commit the result"
