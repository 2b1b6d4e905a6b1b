"""The committed stubs are exactly what the pinned grpcio-tools makes from
proto/atmost/v1/*.proto, so they cannot drift from the wire contract."""

import importlib.util
import pathlib

HERE = pathlib.Path(__file__).resolve().parent.parent
COMMITTED = HERE / "src" / "atmost_client" / "_pb"


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_stubs", HERE / "generate_stubs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    load_generator().generate(tmp_path)
    made = {p.name: p.read_text("utf-8") for p in tmp_path.iterdir() if p.is_file()}
    committed = {p.name: p.read_text("utf-8") for p in COMMITTED.iterdir() if p.is_file()}
    assert sorted(made) == sorted(committed), "the stub files differ: run python generate_stubs.py"
    stale = [name for name in made if made[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `python generate_stubs.py` with the pinned grpcio-tools"
    assert {
        "gate_pb2.py",
        "permits_pb2.py",
        "types_pb2.py",
        "receipts_pb2.py",
        "approvals_pb2.py",
        "gate_pb2_grpc.py",
        "approvals_pb2_grpc.py",
    } <= set(made)
