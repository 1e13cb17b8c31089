"""The grader against cheating or broken candidates.

Each cheat is a copy of the oracles with one check's implementation (llama3's rms_norm, unless
said otherwise) replaced by a cheat with no honest fallback: it gets the answer through a channel
that a Python-level fence does not close (a spawned interpreter that skips the guard, an edited
sys.meta_path, C-level reads of the references, git's object store, another copy on disk, a
report, a loopback service, a cache left by an earlier child). Every cheat is graded twice:
- sealed (the default): it scores 0 on its check, with the reason printed;
- trusted (the Python-level fence alone, as on a machine without namespaces): it scores full
  marks. That control proves the cheat is real, so its sealed 0 is the kernel boundary's doing.
The grader must always return a report and leave the untouched checks alone.
"""
import io
import json
import shutil
import socket
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from catalog.h5schema import read_reference, write_arrays
from catalog.tasks import compose_task
from grader.app import grade
from grader.isolation.exchange import read_outputs
from grader.isolation.gate import run_sandboxed, static_scan
from grader.probes.common import run_probes

pytestmark = [pytest.mark.sandbox, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
TASK = "llama3-sft"
LLAMA = "jax_oracles/models/llama3.py"
LAYERS = "jax_oracles/models/layers.py"  # the shared layers llama3 composes: rms_norm, eager_attention, MLPs
RMS_NORM_DEF = "def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]\n"
L1 = ("rms_norm", "rope", "mlp", "activation", "attention_core", "attention_block", "lora_linear", "data_tokens",
      "data_labels", "collate")
# the mlp and attention_block checks load the params, which traces the whole model (conversion:
# jax.eval_shape(model.init)), so a cheat inside rms_norm that raises reaches them too
BESIDE_RMS_NORM = ("rope", "activation", "attention_core", "lora_linear", "data_tokens", "data_labels", "collate")
DEV_SITE = sysconfig.get_paths()["purelib"]  # the dev venv's site-packages: torch lives there
ANSWER = "L1/rms_norm/outputs/y"
TORCH = '"".join(map(chr, (116, 111, 114, 99, 104)))'  # "torch", spelled so that no file decides it


def _candidate(tmp_path: Path) -> Path:
    cand = tmp_path / "cand"
    for tree in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / tree, cand / tree, ignore=shutil.ignore_patterns("__pycache__"))
    return cand


def _plant(cand: Path, rel: str, anchor: str, code: str, indent: str = "    ") -> None:
    """Insert `code` (the start of a function body) right after the line `anchor`."""
    p = cand / rel
    text = p.read_text()
    assert text.count(anchor) == 1, f"{rel}: the anchor must occur exactly once"
    body = textwrap.indent(textwrap.dedent(code).strip("\n"), indent) + "\n"
    p.write_text(text.replace(anchor, anchor + body))


def _grade(cand, tmp_path, levels, task=TASK, **kw) -> dict:
    report_dir = tmp_path / f"reports-{time.monotonic_ns()}"
    report = grade(compose_task(task), cand, ROOT / "references", report_dir, quiet=True, levels=levels, **kw)
    # the grader returned a full report and wrote it, whatever the candidate did
    assert json.loads((report_dir / f"{task}.json").read_text())["checks"] == report["checks"]
    assert report["checks"] and all(0.0 <= c["score"] <= 1.0 for c in report["checks"])
    return report


def _by_name(report, level="L1") -> dict:
    return {c["name"]: c for c in report["checks"] if c["level"] == level}


def _assert_untouched(checks: dict, *names) -> None:
    for name in names:
        assert checks[name]["score"] >= 0.999 and checks[name]["reason"] is None, checks[name]


def _spelled(path: Path) -> str:
    """A Python expression that builds `path` at run time from pieces: no literal for the static scan,
    and no single string naming references/ for the guard's spawn check."""
    parts = [p[:2] + '" + "' + p[2:] if len(p) > 2 else p for p in path.parts[1:]]
    return "os.path.join(os.sep, " + ", ".join(f'"{p}"' for p in parts) + ")"


# ---------------------------------------------------------------- (a) torch at run time

def test_a_torch_import_built_at_run_time_scores_zero_on_its_check(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LAYERS, RMS_NORM_DEF, '__import__("importlib").import_module("".join(map(chr, (116, 111, 114, 99, 104))))')
    assert static_scan(cand) == []  # undecidable from the file: only the child can stop it
    report = _grade(cand, tmp_path, ("L1",))
    checks = _by_name(report)
    assert checks["rms_norm"]["score"] == 0.0
    assert "torch import" in checks["rms_norm"]["reason"], checks["rms_norm"]
    _assert_untouched(checks, *BESIDE_RMS_NORM)


# The torch twin of rms_norm, run wherever a cheat manages to import torch.
_TORCH_RMS = """\
import sys
sys.path[:0] = SITES
import numpy as np
t = __import__(TORCH)
d = np.load(sys.argv[1])
x, w = t.from_numpy(d["x"]), t.from_numpy(d["w"])
np.save(sys.argv[2], (x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(d["eps"])) * w).numpy())
"""


def _torch_prog(sites) -> str:
    return _TORCH_RMS.replace("SITES", repr(list(sites))).replace("TORCH", TORCH)


_SPAWN_PRELUDE = """
import os, subprocess, sys, tempfile
import numpy as np
scratch = tempfile.mkdtemp()
src, dst = os.path.join(scratch, "in.npz"), os.path.join(scratch, "out.npy")
np.savez(src, x=np.asarray(x), w=np.asarray(weight), eps=np.float32(eps))
"""

# Each spawns an interpreter that the in-process guard never reaches, imports torch there (from the
# dev venv, a path it knows) and computes the answer.
_SPAWNS = {
    "-I": "subprocess.run([sys.executable, '-I', '-c', PROG, src, dst], check=True, capture_output=True)",
    "-S": "subprocess.run([sys.executable, '-S', '-c', PROG, src, dst], check=True, capture_output=True)",
    # the dev venv's interpreter with an empty environment: no PYTHONPATH, so no sitecustomize guard
    "another python": "subprocess.run([DEV_PYTHON, '-c', PROG, src, dst], check=True, capture_output=True, env={})",
    "posix_spawn": """
        pid = os.posix_spawn(sys.executable, [sys.executable, '-I', '-c', PROG, src, dst], {})
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the spawned interpreter failed"
        """,
}


def _torch_cheats() -> dict[str, str]:
    cheats = {}
    for how, spawn in _SPAWNS.items():
        cheats[f"spawn {how}"] = (_SPAWN_PRELUDE + textwrap.dedent(spawn).strip() + "\nreturn np.load(dst)\n") \
            .replace("PROG", repr(_torch_prog([DEV_SITE]))).replace(
                "DEV_PYTHON", _spelled(ROOT / ".venv" / "bin" / "python"))
    # a multiprocessing worker (spawn start method): a fresh interpreter that runs -I and never installs the
    # guard, importing the repo's torch_sources next to torch
    cheats["multiprocessing worker"] = f"""
        import multiprocessing, os
        import numpy as np
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_cheat_worker, (np.asarray(x), np.asarray(weight), float(eps),
                                              [{DEV_SITE!r}, {_spelled(ROOT)}]))
        """
    # the guard's import blocker taken off sys.meta_path, then torch imported in process
    cheats["sys.meta_path edited"] = f"""
        import importlib, sys
        import numpy as np
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "BlockForbidden"]
        sys.path[:0] = [{DEV_SITE!r}]
        t = importlib.import_module({TORCH})
        xt, wt = t.from_numpy(np.asarray(x)), t.from_numpy(np.asarray(weight))
        return (xt * t.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps) * wt).numpy()
        """
    return cheats


_WORKER = f"""

def _cheat_worker(x, w, eps, paths):
    import sys
    sys.path[:0] = paths
    import importlib
    t = importlib.import_module({TORCH})
    importlib.import_module({TORCH} + "_sources.models.llama3")
    xt, wt = t.from_numpy(x), t.from_numpy(w)
    return (xt * t.rsqrt(xt.pow(2).mean(-1, keepdim=True) + eps) * wt).numpy()
"""


def _read_answer(how: str, ref: Path) -> str:
    """The recorded answer through one channel to the reference file at `ref`."""
    grab = f'\nwith h5py.File(io.BytesIO(blob), "r") as f:\n    return f["{ANSWER}"][()]\n'
    return {
        # libc's open/read: C calls, out of the audit hook's sight
        "ctypes": textwrap.dedent(f"""
            import ctypes, io, os
            import h5py
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.open({_spelled(ref)}.encode(), os.O_RDONLY)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "open failed")
            buf, chunks = ctypes.create_string_buffer(1 << 20), []
            while (got := libc.read(fd, buf, len(buf))) > 0:
                chunks.append(buf.raw[:got])
            libc.close(fd)
            blob = b"".join(chunks)
            """) + grab,
        # an HDF5 external link: libhdf5 opens the target file itself
        "hdf5 external link": textwrap.dedent(f"""
            import os, tempfile
            import h5py
            p = os.path.join(tempfile.mkdtemp(), "link.h5")
            with h5py.File(p, "w") as f:
                f["y"] = h5py.ExternalLink({_spelled(ref)}, "/{ANSWER}")
            with h5py.File(p, "r") as f:
                return f["y"][()]
            """),
        # a shell assembles the path from two pieces no single string of which names references/
        "shell": textwrap.dedent(f"""
            import io, os, subprocess
            import h5py
            blob = subprocess.run(["sh", "-c", 'cat "$0/$1"', {_spelled(ref.parent.parent)},
                                   "refer" + "ences/" + {ref.name!r}], check=True, capture_output=True).stdout
            """) + grab,
        # a hard link made relative to a directory descriptor, then read under its new name
        "hard link via dir_fd": textwrap.dedent(f"""
            import io, os, tempfile
            import h5py
            top = os.open({_spelled(ref.parent.parent)}, os.O_RDONLY)
            dst = os.path.join(tempfile.mkdtemp(dir={_spelled(ref.parent.parent.parent)}), "h.h5")
            os.link("refer" + "ences/" + {ref.name!r}, dst, src_dir_fd=top)
            blob = open(dst, "rb").read()
            os.unlink(dst)
            """) + grab,
        # git's object store holds every committed reference
        "git cat-file": textwrap.dedent(f"""
            import io, os, subprocess
            import h5py
            blob = subprocess.run(["git", "--git-dir", {_spelled(ref.parent.parent / ".git")}, "cat-file", "blob",
                                   "HEAD:" + "refer" + "ences/" + {ref.name!r}], check=True, capture_output=True).stdout
            """) + grab,
        # the same file elsewhere on disk, where no deny list looks
        "another copy": textwrap.dedent(f"""
            import io, os
            import h5py
            blob = open({_spelled(ref)}, "rb").read()
            """) + grab,
    }[how]


READS = ("ctypes", "hdf5 external link", "shell", "hard link via dir_fd", "git cat-file", "another copy")


def _cheat_source(how: str, tmp_path: Path) -> str:
    if how in READS:
        ref = ROOT / "references" / f"{TASK}.h5"
        if how == "another copy":
            ref = tmp_path / "elsewhere" / "copy.h5"
            ref.parent.mkdir()
            shutil.copy2(ROOT / "references" / f"{TASK}.h5", ref)
        return _read_answer(how, ref)
    if how == "report":  # a report left by an earlier grade (reports/<task>.json holds loss series)
        report = tmp_path / "checkout" / "reports" / f"{TASK}.json"
        report.parent.mkdir(parents=True)
        y = read_reference(ROOT / "references" / f"{TASK}.h5").checks["L1/rms_norm"].outputs["y"]
        report.write_text(json.dumps({"series": {"L1/rms_norm/y": {"reference": y.tolist()}}}))
        return f"""
            import json, os
            import numpy as np
            with open({_spelled(report)}) as f:
                return np.asarray(json.load(f)["series"]["L1/rms_norm/y"]["reference"], np.float32)
            """
    return _torch_cheats()[how]


CHEATS = (*(f"spawn {h}" for h in _SPAWNS), "multiprocessing worker", "sys.meta_path edited", *READS, "report")


# CI runs one interpreter spawn ("another python": no guard at all), one read through native code, one through
# a file format and one through an earlier report; the other channels in make test-full (CI time, ~45 s)
_CI_ONLY = ("spawn another python", "ctypes", "hdf5 external link", "report")
_CI_CHEATS = [h if h in _CI_ONLY else pytest.param(h, marks=pytest.mark.slow) for h in CHEATS]


@pytest.mark.parametrize("how", _CI_CHEATS)
def test_a_cheat_scores_zero_sealed_and_full_marks_behind_the_python_fence_alone(tmp_path, how):
    cand = _candidate(tmp_path)
    _plant(cand, LAYERS, RMS_NORM_DEF, _cheat_source(how, tmp_path))
    if how == "multiprocessing worker":
        with open(cand / LAYERS, "a") as f:
            f.write(_WORKER)
    assert static_scan(cand) == [], "the cheat must get past the static scan: only the child can stop it"

    sealed = _by_name(_grade(cand, tmp_path, ("L1",), only_checks=("rms_norm",)))["rms_norm"]
    print(f"{how}: sealed score {sealed['score']}, reason: {sealed['reason']}")
    assert sealed["score"] == 0.0 and sealed["reason"], sealed

    fenced = _by_name(_grade(cand, tmp_path, ("L1",), only_checks=("rms_norm",), trusted=True))["rms_norm"]
    assert fenced["score"] >= 0.999, f"the cheat does not work even without the sandbox: {fenced}"


# ---------------------------------------------------------------- a loopback service

def _serve(payload: bytes) -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def loop():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                conn.sendall(payload)

    threading.Thread(target=loop, daemon=True).start()
    return server, server.getsockname()[1]


def test_a_loopback_service_reached_through_the_c_socket_module_is_out_of_reach(tmp_path):
    y = read_reference(ROOT / "references" / f"{TASK}.h5").checks["L1/rms_norm"].outputs["y"]
    buf = io.BytesIO()
    np.save(buf, y)
    server, port = _serve(buf.getvalue())
    try:
        cand = _candidate(tmp_path)
        # _socket.socket is the C type under socket.socket: the guard's patch of the latter misses it
        _plant(cand, LAYERS, RMS_NORM_DEF, f"""
            import _socket, io
            import numpy as np
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            s.connect(("127.0.0.1", {port}))
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
            return np.load(io.BytesIO(data))
            """)
        sealed = _by_name(_grade(cand, tmp_path, ("L1",), only_checks=("rms_norm",)))["rms_norm"]
        print(f"loopback service: sealed reason: {sealed['reason']}")
        assert sealed["score"] == 0.0 and "Connection refused" in sealed["reason"], sealed
        fenced = _by_name(_grade(cand, tmp_path, ("L1",), only_checks=("rms_norm",), trusted=True))["rms_norm"]
        assert fenced["score"] >= 0.999, fenced
    finally:
        server.close()


# ---------------------------------------------------------------- a cache left by an earlier child

ADD_REQUEST_DEF = ("    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],\n"
                   "                    sampling_params: SamplingParams | None = None) -> None:\n")
GENERATE_DEF = ("    def generate(self, prompts: Sequence[Sequence[int]],\n"
                "                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None)"
                " -> list[RequestOutput]:\n")


@pytest.mark.slow  # CI time (~29 s): tests/grader/test_sandbox.py's empty HOME and /tmp per child stay in CI
def test_a_cache_left_in_home_or_tmp_by_one_child_is_gone_for_the_next(tmp_path, monkeypatch):
    # One child leaves a file in $HOME and /tmp; a later child depends on finding it. The writer runs only
    # in the L6 grade (the only requests asking for prompt logprobs); L5's generate refuses to answer
    # without the file, and answers honestly with it, so the fenced control shows the channel is real.
    cand = _candidate(tmp_path)
    _plant(cand, "serving_engine/engine.py", ADD_REQUEST_DEF, """
        import os
        if sampling_params is not None and sampling_params.prompt_logprobs is not None:
            for where in (os.path.expanduser("~"), "/tmp"):
                with open(os.path.join(where, ".t2j-stash"), "a") as f:
                    f.write(str(request_id) + "\\n")
        """, indent=" " * 8)
    _plant(cand, "serving_engine/engine.py", GENERATE_DEF, """
        import os
        asked = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params]
        if (all(p is None or p.prompt_logprobs is None for p in asked)  # not the writer's own L6 run
                and not any(os.path.exists(os.path.join(w, ".t2j-stash"))
                            for w in (os.path.expanduser("~"), "/tmp"))):
            raise KeyError("nothing was left behind")
        """, indent=" " * 8)
    sealed6 = _by_name(_grade(cand, tmp_path, ("L6",), task="llama3-core", only_checks=("heldout_logprobs",)), "L6")
    assert sealed6["heldout_logprobs"]["score"] >= 0.999  # the stash is written; L6 itself is honest
    sealed5 = _by_name(_grade(cand, tmp_path, ("L5",), task="llama3-core", only_checks=("greedy_sequences",)),
                       "L5")["greedy_sequences"]
    print(f"cache: sealed reason: {sealed5['reason']}")
    assert sealed5["score"] == 0.0 and "KeyError" in sealed5["reason"], sealed5

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the fenced control's cache lands here, not in ~
    (tmp_path / "home").mkdir()
    try:  # behind the fence alone the child's /tmp is the host's: the stash there is removed afterwards
        _grade(cand, tmp_path, ("L6",), task="llama3-core", only_checks=("heldout_logprobs",), trusted=True)
        fenced5 = _by_name(_grade(cand, tmp_path, ("L5",), task="llama3-core", only_checks=("greedy_sequences",),
                                  trusted=True), "L5")["greedy_sequences"]
    finally:
        Path("/tmp/.t2j-stash").unlink(missing_ok=True)
    assert fenced5["score"] >= 0.999, fenced5  # the file survived from one child to the next


# ---------------------------------------------------------------- the exchange: outputs are untrusted data

def test_an_output_file_swapped_for_a_link_to_the_references_scores_zero(tmp_path):
    cand = _candidate(tmp_path)
    # at exit (the child leaves through os._exit, which the candidate wraps) it replaces its outputs with a
    # symlink to the reference: a grader that followed it would read recorded answers as the candidate's
    _plant(cand, LAYERS, RMS_NORM_DEF, f"""
        import os, sys
        frame = sys._getframe()
        while "outputs_path" not in frame.f_locals:
            frame = frame.f_back
        out = frame.f_locals["outputs_path"]
        real_exit = os._exit
        def swap_then_exit(code):
            os.unlink(out)
            os.symlink({str(ROOT / "references" / f"{TASK}.h5")!r}, out)
            real_exit(code)
        os._exit = swap_then_exit
        """)
    checks = _by_name(_grade(cand, tmp_path, ("L1",)))
    for c in checks.values():
        assert c["score"] == 0.0 and c["reason"].startswith("untrusted output: cannot open"), c


# ---------------------------------------------------------------- the Python-level fence (alone when trusted)

_CHANNELS = """
import glob, json, os, pathlib, shutil, subprocess, sys
import h5py
import numpy as np

def attempts(d, scratch):
    f = os.path.join(d, "ref.h5")
    def symlink():
        os.symlink(d, os.path.join(scratch, "alias"))
        return open(os.path.join(scratch, "alias", "ref.h5"), "rb").read()
    def chdir_then_open():
        here = os.getcwd()
        try:
            os.chdir(d)
            return open("ref.h5", "rb").read()
        finally:
            os.chdir(here)
    return {
        "open": lambda: open(f, "rb").read(),
        "os.open": lambda: os.read(os.open(f, os.O_RDONLY), 8),
        "dir_fd": lambda: os.read(os.open(os.path.join(os.path.basename(d), "ref.h5"), os.O_RDONLY,
                                          dir_fd=os.open(os.path.dirname(d), os.O_RDONLY)), 8),
        "pathlib": lambda: pathlib.Path(f).read_bytes(),
        "numpy": lambda: np.fromfile(f, np.uint8).size,
        "listdir": lambda: os.listdir(d),
        "scandir": lambda: [e.name for e in os.scandir(d)],
        "glob": lambda: glob.glob(os.path.join(d, "*")),
        "copy": lambda: shutil.copy(f, os.path.join(scratch, "copy.h5")),
        "hardlink": lambda: os.link(f, os.path.join(scratch, "hard.h5")) or True,
        "symlink": symlink,
        "chdir": chdir_then_open,
        "h5py": lambda: h5py.File(f, "r")["x"][()].size,
        "h5py.h5f": lambda: h5py.h5f.open(f.encode()),
        "subprocess": lambda: subprocess.run(["cat", f], check=True, capture_output=True).stdout,
        # the path goes through stdin, out of the spawn's sight: the child's own guard refuses it
        "python child": lambda: subprocess.run(
            [sys.executable, "-c", "import sys; open(sys.stdin.read(), 'rb').read()"],
            input=f.encode(), check=True, capture_output=True),
    }

def main(inputs_path, outputs_path):
    cfg = json.load(open(inputs_path))
    result = {}
    for name, attempt in attempts(cfg["dir"], cfg["scratch"]).items():
        try:
            result[name] = "read" if attempt() else "nothing"
        except (PermissionError, subprocess.CalledProcessError) as e:
            text = str(e) + str(getattr(e, "stderr", b"") or b"")
            result[name] = "refused" if "reads references/" in text else f"other: {text[:200]}"
        except Exception as e:
            result[name] = f"other: {type(e).__name__}: {e}"[:200]
    json.dump(result, open(outputs_path, "w"))
"""


def _channels(tmp_path, deny: bool, trusted: bool = True) -> dict:
    tag = f"{deny}-{trusted}"
    secret, scratch = tmp_path / (f"secret-{tag}" if deny else f"open-{tag}"), tmp_path / f"scratch-{tag}"
    secret.mkdir()
    scratch.mkdir()
    with h5py.File(secret / "ref.h5", "w") as f:
        f["x"] = np.arange(3)
    cand = tmp_path / f"cand-{tag}"
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "__init__.py").write_text("")
    (cand / "jax_oracles" / "entry.py").write_text(_CHANNELS)
    inputs, out = tmp_path / f"in-{tag}", tmp_path / f"out-{tag}"
    inputs.mkdir()
    out.mkdir()
    (inputs / "in.json").write_text(json.dumps({"dir": str(secret), "scratch": str(scratch) if trusted else "/tmp"}))
    res = run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, 60.0, inputs_name="in.json",
                        outputs_name="out.json", deny_read=(secret,) if deny else (), trusted=trusted)
    assert res.ok, res.stderr_tail
    return json.loads((out / "out.json").read_text())


def test_every_python_file_channel_to_a_denied_directory_is_refused_by_the_fence(tmp_path):
    # the Python-level fence alone (trusted mode): each channel it knows of is refused with a precise reason
    refused = _channels(tmp_path, deny=True)
    # glob swallows the OSError and finds nothing; every other channel raises
    assert not {k: v for k, v in refused.items() if v != ("nothing" if k == "glob" else "refused")}
    allowed = _channels(tmp_path, deny=False)  # the same attempts on a directory not denied succeed
    assert not {k: v for k, v in allowed.items() if v != "read"}
    assert set(allowed) == set(refused) and len(refused) == 16


def test_sealed_every_channel_to_a_host_directory_finds_nothing_there(tmp_path):
    # sealed, no deny list is needed: the directory is not in the child's view at all
    sealed = _channels(tmp_path, deny=False, trusted=False)
    assert len(sealed) == 16 and not [k for k, v in sealed.items() if v == "read"], sealed
    assert sealed["open"].startswith("other: FileNotFoundError"), sealed


def test_a_run_killed_by_reading_references_says_so(tmp_path):
    cand = tmp_path / "cand"
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "entry.py").write_text(
        f"def main(inputs_path, outputs_path):\n    open({str(ROOT / 'references' / (TASK + '.h5'))!r}, 'rb')\n")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "in.json").write_text("{}")
    for trusted, reason in ((True, "reads references/"), (False, "FileNotFoundError")):
        out = tmp_path / f"out-{trusted}"
        out.mkdir()
        res = run_sandboxed(cand, "jax_oracles.entry:main", tmp_path / "in", out, 60.0, inputs_name="in.json",
                            trusted=trusted)
        assert not res.ok and reason in res.reason, (res.reason, res.stderr_tail)


# ---------------------------------------------------------------- (c) echoing the inputs

def test_echoing_the_input_is_not_the_answer(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LAYERS, RMS_NORM_DEF, "return x")
    checks = _by_name(_grade(cand, tmp_path, ("L1",)))
    assert checks["rms_norm"]["score"] < 0.9, checks["rms_norm"]  # rms(x) ~ 3: the norm ratio catches it
    _assert_untouched(checks, *(n for n in L1 if n != "rms_norm"))


# ---------------------------------------------------------------- (d) hangs

@pytest.mark.slow  # CI time (~22 s): the sandbox's own timeout tests (tests/grader) stay in CI; make test-full runs it
def test_a_hanging_check_times_out_alone(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LAYERS, "def eager_attention(q, k, v, mask, scale: float, bias=None, sinks=None):\n", """
        while True:
            pass
        """)
    started = time.perf_counter()
    checks = _by_name(_grade(cand, tmp_path, ("L1",), check_timeout_s=6.0))  # the others take ~2 s at most
    for name in ("attention_core", "mlp", "attention_block"):  # these trace the whole model (see BESIDE_RMS_NORM)
        assert checks[name]["score"] == 0.0 and checks[name]["reason"].startswith("timeout"), checks[name]
        assert 6.0 <= checks[name]["seconds"] < 20.0, checks[name]
    _assert_untouched(checks, "rms_norm", "rope", "activation", "lora_linear", "data_tokens", "data_labels",
                      "collate")
    assert time.perf_counter() - started < 60.0


def test_run_probes_limits_each_check_and_keeps_going(tmp_path):
    inputs, outputs = tmp_path / "in.h5", tmp_path / "out.npz"
    checks = ["L1/spin", "L1/swallow", "L1/stubborn", "L1/fine", "L1/crash"]
    write_arrays(inputs, {}, attrs={"meta": {"checks": checks, "check_timeout_s": 0.3}})

    def spin(ctx, inp):
        while True:
            pass

    def swallow(ctx, inp):  # the alarm is no Exception, and it re-fires until the probe lets go
        while True:
            try:
                time.sleep(10)
            except Exception:
                pass

    def stubborn(ctx, inp):  # catches the first alarms and returns as if nothing happened
        for _ in range(3):
            try:
                time.sleep(10)
            except BaseException:
                pass
        return {"y": np.zeros(1)}

    probes = {"spin": spin, "swallow": swallow, "stubborn": stubborn,
              "fine": lambda ctx, inp: {"y": np.ones(2)}, "crash": lambda ctx, inp: 1 / 0}
    started = time.perf_counter()
    run_probes(inputs, outputs, lambda meta: None, probes)
    assert time.perf_counter() - started < 8.0
    groups, errors, seconds = read_outputs(outputs, checks)
    assert set(groups) == {"L1/fine"} and np.array_equal(groups["L1/fine"]["y"], np.ones(2))
    for key in ("L1/spin", "L1/swallow", "L1/stubborn"):
        assert errors[key].startswith("timeout"), errors
    assert errors["L1/crash"].startswith("crash: ZeroDivisionError")


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_timed_level_shares_one_cpu_budget_from_the_childs_start(tmp_path):
    """L5 checks share time_budget_s CPU seconds, setup included, not check_timeout_s: a slow first check
    leaves the next one what is left; once it is spent, the rest fail without running; a quick check before
    it passes. Sleeping costs no CPU: the wall-clock backstop is the grader's (tests/grader/test_clock.py)."""
    inputs, outputs = tmp_path / "in.h5", tmp_path / "out.npz"
    checks = ["L5/quick", "L5/slow", "L5/after"]
    write_arrays(inputs, {}, attrs={"meta": {"checks": checks, "check_timeout_s": 0.1, "time_budget_s": 1.5}})
    ran = []

    def make_ctx(meta):
        _burn(0.5)  # the candidate's setup counts

    def quick(ctx, inp):
        time.sleep(0.3)  # past check_timeout_s, within the budget: L5 is not limited per check
        _burn(0.3)
        return {"y": np.ones(1)}

    def after(ctx, inp):  # more CPU than a sliver: on a loaded machine SIGPROF may fire a few ms early
        _burn(0.3)
        ran.append(1)
        return {"y": np.ones(1)}

    probes = {"quick": quick, "slow": lambda ctx, inp: _burn(10), "after": after}
    run_probes(inputs, outputs, make_ctx, probes, cpu_origin=time.process_time())
    groups, errors, seconds = read_outputs(outputs, checks)
    assert set(groups) == {"L5/quick"}, errors
    assert errors["L5/slow"].startswith("timeout") and "CPU-s" in errors["L5/slow"], errors
    # wall seconds of a check stopped at 0.7 CPU-s: a loaded machine (another test worker) stretches them, yet
    # they stay far below the 10 CPU-s the check would burn unstopped
    assert 0.4 <= seconds["L5/slow"] < 5.0, (errors, seconds)
    # spent: skipped, or (a sliver left on a loaded machine) stopped at once
    assert errors["L5/after"].startswith("timeout") and not ran, errors


# A candidate that stops every clock and timer it can reach inside its child (time.*, the interval timers,
# the signal handlers) and then runs past its L5 budget: the grader's clock is outside it.
STOP_CLOCKS = """
import signal as _s, time as _t
_t.process_time = _t.perf_counter = _t.monotonic = _t.time = lambda: 0.0
_s.setitimer = lambda *a, **k: (0.0, 0.0)
_s.signal(_s.SIGPROF, _s.SIG_IGN)
_s.signal(_s.SIGALRM, _s.SIG_IGN)
"""
RUN_STEPS_DEF = "def _run_steps(model: CausalLM, lora, tx, steps, pad_token_id: int, shape) -> tuple[list[float], dict]:\n"


@pytest.mark.parametrize("how, kind", [("burns CPU", "CPU-s"), pytest.param("sleeps", "wall clock",
                                                                           marks=pytest.mark.slow)])
def test_a_candidate_that_stops_its_own_clock_and_runs_past_its_budget_scores_zero(tmp_path, how, kind):
    from grader.timing.budget import BudgetPolicy
    cand = _candidate(tmp_path)
    tail = "while True:\n    pass\n" if how == "burns CPU" else \
        "__import__('select').select([], [], [], 1000)\n"
    _plant(cand, "jax_oracles/training/sft.py", RUN_STEPS_DEF, STOP_CLOCKS + tail)
    # a budget of about what the oracle itself takes: the test stays short. The wall backstop sits at three times
    # it, so that on a loaded machine (the child given a third of a core) the CPU clock still fires first
    policy = BudgetPolicy(headroom=1.0, factor=1.0, wall_factor=1.0 if how == "sleeps" else 3.0, wall_slack_s=5.0,
                          scale=False)
    started = time.monotonic()
    report = _grade(cand, tmp_path, ("L5",), budget=policy)
    checks = _by_name(report, "L5")
    b = report["budgets"]["L5"]
    for name in ("e2e_step_losses", "e2e_adapter", "e2e_eval_loss"):
        assert checks[name]["score"] == 0.0, checks[name]
        assert checks[name]["reason"].startswith("timeout") and "grader's" in checks[name]["reason"], checks[name]
        assert kind in checks[name]["reason"], checks[name]
    if how == "burns CPU":
        assert b["kill_at_cpu_s"] <= b["used_cpu_s"] < b["kill_at_cpu_s"] + 3, b
    else:
        assert b["wall_limit_s"] <= b["used_wall_s"] < b["wall_limit_s"] + 5 and b["used_cpu_s"] < b["budget_cpu_s"], b
    assert time.monotonic() - started < 120


# ---------------------------------------------------------------- what a child may take from the machine
# Each attack is planted where only the L1 data checks run it (the dataset loader), so the L1 child is the one
# killed, with the reason, while L2's child grades normally; the caps are the grader's (grader/isolation/clock.py).

LOADER_DEF = "def load_processed_dataset(tokenizer_dir, data_dir, split: str, args: TrainArgs) -> list[dict]:\n"
ATTACKS = {
    "disk": ("import os\nchunk = b'x' * (1 << 20)\nfor i in range(4096):\n"
             "    with open(os.path.join('/t2j/out', f'f{i}'), 'wb') as f:\n        f.write(chunk)\n", "disk:"),
    "stdout flood": ("import sys\nline = 'y' * 4096\nwhile True:\n    try:\n        print(line)\n"
                     "    except OSError:\n        pass\n", "disk:"),
    "memory": ("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n", "memory:"),
    "processes": ("import threading, time\nfor _ in range(100000):\n"
                  "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n", "processes:"),
}


def _leftovers() -> tuple[set[str], set[str]]:
    """Grader scratch directories and cgroups of this process: what a grading must not leave behind."""
    import glob
    import os
    import tempfile
    scratch = set(glob.glob(os.path.join(tempfile.gettempdir(), "t2j-*")))
    groups = set(glob.glob(f"/sys/fs/cgroup/**/t2j-{os.getpid()}-*", recursive=True))
    return scratch, groups


@pytest.fixture
def private_scratch(tmp_path, monkeypatch):
    """The grader's scratch directories under this test's own directory, so that another grading on the
    machine (a sweep, a second job) cannot pass for a leftover of this one."""
    import tempfile
    d = tmp_path / "scratch"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.mark.parametrize("attack", [a if a == "disk" else pytest.param(a, marks=pytest.mark.slow)
                                    for a in sorted(ATTACKS)])
def test_a_child_that_takes_the_machine_scores_zero_with_the_reason(tmp_path, attack, private_scratch):
    from dataclasses import replace
    from grader.app import child_caps
    code, reason = ATTACKS[attack]
    cand = _candidate(tmp_path)
    _plant(cand, "jax_oracles/training/sft.py", LOADER_DEF, code)
    before = _leftovers()
    caps = replace(child_caps(compose_task(TASK)), file_bytes=32 << 20, disk_bytes=128 << 20, tasks=256,
                   memory_bytes=3 << 30)  # the defaults' kind, smaller: a quick test
    started = time.monotonic()
    report = _grade(cand, tmp_path, ("L1", "L2"), caps=caps)
    assert time.monotonic() - started < 240
    l1, l2 = _by_name(report, "L1"), _by_name(report, "L2")
    for name in ("data_tokens", "data_labels", "collate"):
        assert l1[name]["score"] == 0.0 and l1[name]["reason"].startswith(reason), l1[name]
    _assert_untouched(l2, *l2)
    assert _leftovers() == before  # no scratch directory, no cgroup; the killed tree is gone with them


MARK = "t2j-sigterm-proof-grandchild"


def _alive_with(mark: str) -> list[int]:
    import os
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_a_grandchild_that_ignores_sigterm_and_leaves_its_session_dies_with_the_child(tmp_path, private_scratch):
    """The L5 child starts a grandchild that ignores SIGTERM, calls setsid and spins, then runs past its
    budget: the grader kills the whole tree (bwrap's PID namespace and the cgroup), nothing survives."""
    from grader.timing.budget import BudgetPolicy
    cand = _candidate(tmp_path)
    spawn = (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import os, signal\\n"
             f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nos.setsid()\\nwhile True: pass', '{MARK}'])\n"
             "while True:\n    pass\n")
    _plant(cand, "jax_oracles/training/sft.py", RUN_STEPS_DEF, spawn)
    before = _leftovers()
    policy = BudgetPolicy(headroom=1.0, factor=1.0, wall_factor=1.0, wall_slack_s=5.0, scale=False)
    checks = _by_name(_grade(cand, tmp_path, ("L5",), budget=policy), "L5")
    assert checks["e2e_step_losses"]["reason"].startswith("timeout: the child's process tree used"), checks
    time.sleep(0.5)
    assert _alive_with(MARK) == [] and _leftovers() == before


def _copy_rollouts(inputs_file: str, n: int):
    """What a cheating generate() returns: the n tokens after each query in the sibling check's rows."""
    with h5py.File(inputs_file, "r") as f:
        if "L3/rollout_logprobs_values" not in f:
            return None
        g = f["L3/rollout_logprobs_values"]
        ids, starts = g["input_ids"][()], g["query_len"][()]
        return np.stack([row[q:q + n] for row, q in zip(ids, starts)])


@pytest.mark.slow
def test_answers_read_off_a_sibling_checks_inputs_are_not_there(tmp_path):
    """PPO's L3 rollout_generate must sample the responses L3 rollout_logprobs_values is recorded on: a candidate
    that copies them out of the inputs file would score full marks if both ran in one child (checked on the
    reference itself), and scores 0 because the grader gives them separate children (grader/isolation/answers.py)."""
    task = "llama3-ppo"
    rec = read_reference(ROOT / "references" / f"{task}.h5").checks
    one_file = tmp_path / "both.h5"
    write_arrays(one_file, {k: rec[k].inputs for k in ("L3/rollout_generate", "L3/rollout_logprobs_values")})
    copied = _copy_rollouts(str(one_file), rec["L3/rollout_generate"].outputs["responses"].shape[1])
    assert np.array_equal(copied, rec["L3/rollout_generate"].outputs["responses"])  # the cheat works on one file
    cand = _candidate(tmp_path)
    _plant(cand, "jax_oracles/training/ppo.py", "             eos_token_ids, pad_token_id: int):\n", """
        import glob, h5py as _h5
        for _path in glob.glob("/t2j/inputs/*.h5"):
            with _h5.File(_path, "r") as _f:
                if "L3/rollout_logprobs_values" in _f:
                    _g = _f["L3/rollout_logprobs_values"]
                    _ids, _q = _g["input_ids"][()], _g["query_len"][()]
                    return jnp.asarray(np.stack([r[q:q + noise.shape[1]] for r, q in zip(_ids, _q)]))
        return jnp.zeros(noise.shape[:2], jnp.int32)
        """)
    checks = _by_name(_grade(cand, tmp_path, ("L3",), task=task), "L3")
    assert checks["rollout_generate"]["score"] < checks["rollout_generate"]["bar"], checks["rollout_generate"]
    _assert_untouched(checks, "rollout_logprobs_values")


# ---------------------------------------------------------------- (e) NaN

def test_a_nan_output_scores_zero(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LAYERS, "    def __call__(self, x):  # f32[..., D] -> f32[..., D]: the gated MLP\n", "x = x * jnp.nan",
           indent=" " * 8)
    checks = _by_name(_grade(cand, tmp_path, ("L1",)))
    assert checks["mlp"]["score"] == 0.0 and "non-finite" in checks["mlp"]["reason"], checks["mlp"]
    _assert_untouched(checks, *(n for n in L1 if n != "mlp"))


# ---------------------------------------------------------------- (f) a candidate that does not import

def test_a_syntax_error_scores_every_check_zero(tmp_path):
    cand = _candidate(tmp_path)
    with open(cand / LLAMA, "a") as f:
        f.write("\ndef half_migrated(:\n")
    report = _grade(cand, tmp_path, ("L1",))
    assert report["reward"] == 0.0 and report["gated"]
    for c in report["checks"]:
        assert c["score"] == 0.0 and "llama3.py" in c["reason"] and "unparseable" in c["reason"], c


def test_a_module_that_fails_at_import_scores_its_levels_zero(tmp_path):
    cand = _candidate(tmp_path)
    with open(cand / LLAMA, "a") as f:
        f.write('\nraise RuntimeError("half-migrated module")\n')
    report = _grade(cand, tmp_path, ("L1",))
    checks = _by_name(report)
    assert set(checks) == set(L1)
    for c in checks.values():
        assert c["score"] == 0.0 and "half-migrated module" in c["reason"], c
        assert c["reason"].startswith("setup: crash: RuntimeError"), c
