"""The kernel boundary itself: what a sealed child sees, that each child starts from nothing, that
the grader refuses (never falls back) where no sandbox can be made, that the verifier env is
torch-free, and that what a child hands back is read as untrusted data."""
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

from catalog.tasks import compose_task
from grader.app import grade
from grader.isolation import gate, sandbox
from grader.isolation.exchange import UntrustedOutput, read_outputs, write_outputs
from grader.isolation.sandbox import SandboxUnavailable

ROOT = Path(__file__).resolve().parents[2]


def run_entry(tmp_path, source: str, timeout_s=60.0, **kw):
    cand = tmp_path / "cand"
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "__init__.py").write_text("")
    (cand / "jax_oracles" / "entry.py").write_text(textwrap.dedent(source))
    inputs, out = tmp_path / "inputs", tmp_path / "out"
    inputs.mkdir()
    out.mkdir()
    (inputs / "in.json").write_text("{}")
    res = gate.run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, timeout_s, inputs_name="in.json",
                             outputs_name="out.json", **kw)
    assert res.ok, (res.reason, res.stderr_tail)
    return json.loads((out / "out.json").read_text())


_LOOK_AROUND = """
import json, os, socket, subprocess, sys
PACKAGES = {"torch", "torchvision", "torchaudio", "transformers", "vllm", "peft", "trl", "torch_sources",
            "recorder"}
REPO_THINGS = {"references", ".git", "reports", ".venv", ".venv-verifier", "torch_sources"} | set(REFERENCE_FILES)

def wanted(dirpath, n):
    if n in REPO_THINGS:
        return True
    if dirpath.endswith("-packages") and n.removesuffix(".py") in PACKAGES:  # importable from an env
        return True
    return n.split("-")[0] in PACKAGES and n.endswith((".whl", ".dist-info", ".egg-info", ".tar.gz"))

def main(inputs_path, outputs_path):
    seen = []
    for top in ("/usr", "/t2j", "/root", "/home", "/tmp", "/etc", "/opt", "/work", "/var", "/srv", "/mnt"):
        for dirpath, dirnames, filenames in os.walk(top):
            seen += [os.path.join(dirpath, n) for n in dirnames + filenames if wanted(dirpath, n)]
    procs = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
             for p in os.listdir("/proc") if p.isdigit()}
    writable = []
    for d in ("/t2j/candidate", "/t2j/venv", "/t2j/grader", "/t2j/inputs", "/usr", "/", "/t2j/out", "/tmp",
              os.environ["HOME"]):
        try:
            open(os.path.join(d, ".probe"), "w").close()
            writable.append(d)
        except OSError:
            pass
    try:
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        net = "connected"
    except Exception as e:
        net = type(e).__name__
    json.dump({"seen": seen, "root": sorted(os.listdir("/")), "env": dict(os.environ), "procs": procs,
               "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
               "interfaces": [l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:]],
               "uid": os.getuid(), "writable": writable, "net": net, "cwd": os.getcwd(),
               "executable": sys.executable, "path": sys.path}, open(outputs_path, "w"))
"""


@pytest.mark.sandbox
def test_a_sealed_child_sees_only_the_verifier_its_copies_and_fresh_scratch(tmp_path):
    references = sorted(p.name for p in (ROOT / "references").glob("*.h5"))
    seen = run_entry(tmp_path, _LOOK_AROUND.replace("REFERENCE_FILES", repr(references)))
    # nothing torch-like, no references, no checkout, no report, anywhere in its view
    assert seen["seen"] == [], seen["seen"]
    assert seen["root"] == sorted(["bin", "dev", "etc", "home", "lib", "lib64", "proc", "sbin", "t2j", "tmp", "usr",
                                   *(["root"] if str(sandbox.verifier().base_prefix).startswith("/root") else [])])
    # no host path in its environment, in any command line it can read (bwrap's included) or its sys.path
    text = json.dumps([seen["env"], seen["cmdline"], seen["procs"], seen["path"], seen["executable"]])
    for host in (str(ROOT), str(tmp_path), "/work"):
        assert host not in text, host
    assert seen["env"]["HOME"] == "/home/sandbox" and seen["cwd"] == "/t2j/candidate"
    # its own PID namespace: bwrap's init and the child, never the grader (pytest)
    assert len(seen["procs"]) == 2 and " --args " in seen["procs"]["1"], seen["procs"]
    assert seen["interfaces"] == ["lo"] and seen["net"] in ("OSError", "PermissionError")
    assert seen["uid"] == 65534
    assert set(seen["writable"]) == {"/t2j/out", "/tmp", "/home/sandbox"}


@pytest.mark.sandbox
def test_home_and_tmp_are_empty_for_every_child(tmp_path):
    source = """
        import json, os
        def main(inputs_path, outputs_path):
            found = {d: sorted(os.listdir(d)) for d in ("/tmp", os.environ["HOME"])}
            for d in found:
                open(os.path.join(d, "left-behind"), "w").write("answer")
            json.dump(found, open(outputs_path, "w"))
        """
    first = run_entry(tmp_path / "a", source)
    second = run_entry(tmp_path / "b", source)
    assert first == second == {"/tmp": [], "/home/sandbox": []}


@pytest.mark.sandbox
def test_a_legitimate_multiprocessing_pool_still_works_sealed(tmp_path):
    out = run_entry(tmp_path, """
        import json, multiprocessing
        def square(v):
            return v * v
        def main(inputs_path, outputs_path):
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                json.dump(pool.map(square, range(4)), open(outputs_path, "w"))
        """)
    assert out == [0, 1, 4, 9]


@pytest.mark.sandbox
def test_a_timeout_kills_everything_the_child_started(tmp_path):
    cand = tmp_path / "cand"
    (cand / "jax_oracles").mkdir(parents=True)
    marker = f"t2j-orphan-{os.getpid()}"
    (cand / "jax_oracles" / "entry.py").write_text(textwrap.dedent(f"""
        import subprocess, time
        def main(inputs_path, outputs_path):
            subprocess.Popen(["sh", "-c", "exec -a {marker} sleep 300"], start_new_session=True)
            time.sleep(300)
        """))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "inputs.h5").write_text("")
    (tmp_path / "out").mkdir()
    res = gate.run_sandboxed(cand, "jax_oracles.entry:main", tmp_path / "in", tmp_path / "out", 3.0)
    assert res.reason == "timeout"
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == "", f"a process the child started outlived it: {left}"


# ---------------------------------------------------------------- no sandbox: refuse, never fall back

@pytest.fixture
def no_namespaces(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(sandbox.ENV_BWRAP, str(fake))
    return fake


def test_without_namespaces_the_grader_refuses_a_candidate(tmp_path, no_namespaces):
    with pytest.raises(SandboxUnavailable, match="cannot make the sandbox's namespaces.*No permissions.*trusted=true"):
        grade(compose_task("llama3-sft"), ROOT, ROOT / "references", tmp_path / "reports", quiet=True)
    assert not (tmp_path / "reports").exists()  # nothing ran, nothing was written


def test_without_bubblewrap_the_grader_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv(sandbox.ENV_BWRAP, str(tmp_path / "absent"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        sandbox.ensure_sandbox()


def test_the_cli_refuses_and_says_how_to_grade_the_oracles(tmp_path, no_namespaces):
    env = {**os.environ, sandbox.ENV_BWRAP: str(no_namespaces)}
    proc = subprocess.run([sys.executable, "-m", "grader", "task=llama3-sft", f"report_dir={tmp_path}/r"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to grade llama3-sft" in proc.stderr and "trusted=true" in proc.stderr


def test_a_missing_verifier_env_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(sandbox.ENV_VERIFIER, str(tmp_path / "no-venv"))
    with pytest.raises(SandboxUnavailable, match="verifier environment .* is missing: run `make verifier`"):
        sandbox.ensure_sandbox()


# ---------------------------------------------------------------- the verifier env

def test_the_verifier_env_is_torch_free_and_has_what_a_candidate_needs():
    v = sandbox.verifier()
    code = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None "
            f"for m in {gate.FORBIDDEN + ('jax', 'flax', 'optax', 'numpy', 'h5py', 'safetensors', 'tokenizers')!r}}}))")
    found = json.loads(subprocess.run([str(v.python), "-I", "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert not [m for m in gate.FORBIDDEN if found[m]]
    assert all(found[m] for m in ("jax", "flax", "optax", "numpy", "h5py", "safetensors", "tokenizers"))


def test_the_build_check_forbids_what_the_gate_forbids():
    text = (ROOT / "tools" / "check_verifier.py").read_text()
    listed = re.search(r"FORBIDDEN = \((.*?)\)", text, re.S).group(1)
    assert tuple(re.findall(r'"([\w_]+)"', listed)) == gate.FORBIDDEN


# ---------------------------------------------------------------- the exchange: untrusted data

KEYS = ["L1/a", "L1/b"]


def _good(path):
    write_outputs(path, {"L1/a": {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "names": np.array(["q", "k"])}},
                  {"L1/b": "crash: ValueError: x"}, {"L1/a": 0.5, "L1/b": 0.1})


def _zip(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def _npy(arr, **kw) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, **kw)
    return buf.getvalue()


META = json.dumps({"checks": ["L1/a"], "errors": {}, "seconds": {"L1/a": 1.0}}).encode()


def test_the_exchange_round_trips_what_a_child_writes(tmp_path):
    _good(tmp_path / "o.npz")
    groups, errors, seconds = read_outputs(tmp_path / "o.npz", KEYS)
    assert np.array_equal(groups["L1/a"]["y"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert groups["L1/a"]["names"].tolist() == ["q", "k"]
    assert errors == {"L1/b": "crash: ValueError: x"} and seconds == {"L1/a": 0.5, "L1/b": 0.1}
    write_outputs(tmp_path / "scalar.npz", {"L1/a": {"s": np.float64(2.5), "n": np.int64(7)}}, {}, {})
    groups, _, _ = read_outputs(tmp_path / "scalar.npz", KEYS)
    assert groups["L1/a"]["s"].shape == () and groups["L1/a"]["s"].dtype == np.float32  # fp32 by contract
    assert groups["L1/a"]["n"] == 7


def _hostile(tmp_path) -> dict:
    """name -> (path of a file a hostile child could leave, what the refusal must say)."""
    ref = ROOT / "references" / "llama3-sft.h5"
    cases = {}

    def case(name, make, says):
        p = tmp_path / f"{name}.npz"
        make(p)
        cases[name] = (p, says)

    case("symlink to a reference", lambda p: p.symlink_to(ref), "cannot open the output file as a plain file")
    case("fifo", lambda p: os.mkfifo(p), "not a regular file")
    case("directory", lambda p: p.mkdir(), "cannot open|not a regular file")
    case("hdf5", lambda p: p.write_bytes(ref.read_bytes()[:4096]), "not a readable zip")
    case("pickled object array", lambda p: _zip(p, {"L1/a/y.npy": _npy(np.array([{"x": 1}], dtype=object),
                                                                       allow_pickle=True), "meta.json": META}),
         "not a plain numeric or string dtype")
    case("structured dtype", lambda p: _zip(p, {"L1/a/y.npy": _npy(np.zeros(2, [("a", "f4")])), "meta.json": META}),
         "not a plain numeric or string dtype")
    huge = _npy(np.zeros(4, np.float32)).replace(b"(4,)", b"(10000000000000,)")
    case("header larger than its data", lambda p: _zip(p, {"L1/a/y.npy": huge, "meta.json": META}),
         "header says")
    case("a check not asked for", lambda p: _zip(p, {"L4/loss/y.npy": _npy(np.zeros(1)), "meta.json": META}),
         "not asked for")
    case("a path in a member name", lambda p: _zip(p, {"../../x/y.npy": _npy(np.zeros(1)), "meta.json": META}),
         "unexpected member")
    case("no meta", lambda p: _zip(p, {"L1/a/y.npy": _npy(np.zeros(1))}), "lacks meta.json")
    case("NaN timing", lambda p: _zip(p, {"L1/a/y.npy": _npy(np.zeros(1)), "meta.json": META.replace(b"1.0", b"NaN")}),
         "not valid JSON")
    case("error that is no string", lambda p: _zip(p, {"meta.json": json.dumps(
        {"checks": [], "errors": {"L1/a": {"x": 1}}, "seconds": {}}).encode()}), "not a string")
    case("meta listing other checks", lambda p: _zip(p, {"L1/a/y.npy": _npy(np.zeros(1)), "meta.json": json.dumps(
        {"checks": ["L1/b"], "errors": {}, "seconds": {}}).encode()}), "lists other checks")
    return cases


def test_anything_unexpected_from_a_child_is_refused_with_the_reason(tmp_path):
    cases = _hostile(tmp_path)
    for name, (path, says) in cases.items():
        with pytest.raises(UntrustedOutput, match=says):
            read_outputs(path, KEYS)
    assert len(cases) == 13


def test_sizes_are_bounded_before_anything_is_allocated(tmp_path, monkeypatch):
    from grader.isolation import exchange
    _good(tmp_path / "o.npz")
    monkeypatch.setattr(exchange, "MAX_BYTES", 64)
    with pytest.raises(UntrustedOutput, match="over the 64 limit"):
        read_outputs(tmp_path / "o.npz", KEYS)
    monkeypatch.setattr(exchange, "MAX_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.npz"  # 64 MiB of zeros deflate to ~64 KiB
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("L1/a/y.npy", _npy(np.zeros(16 << 20, np.float32)))
        z.writestr("meta.json", META)
    assert bomb.stat().st_size < (1 << 20)
    with pytest.raises(UntrustedOutput, match="unpacks to over"):
        read_outputs(bomb, KEYS)
