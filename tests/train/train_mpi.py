#!/usr/bin/env python3
"""tandem-train under `mpirun -n 4 --backend mpi`, end to end: it trains,
saves checkpoints, resumes with the same losses, resumes on another layout,
writes a merged trace of all ranks and exports whole tensors; a bad layout
fails with a clear message; the Llama and Mixtral fixtures fine-tune on a
token file with the losses of the same layout on rank threads. One JUnit test case per check (tools/junit_summary.py).

usage: train_mpi.py MPIRUN TANDEM_TRAIN JUNIT_OUT"""
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import xml.sax.saxutils as su

mpirun, train, junit = sys.argv[1:4]
MPI = [mpirun, "-n", "4", "--oversubscribe", "--allow-run-as-root"]
TINY = ["--backend", "mpi", "--d-model", "32", "--heads", "4", "--hidden", "32", "--keys", "8",
        "--values", "4", "--pairs", "6", "--queries", "10", "--batch", "4", "--warmup", "2",
        "--lr", "1e-2", "--progress", "plain", "--log-every", "1"]
cases = []


def run(args, expect_ok=True):
    p = subprocess.run(MPI + [train] + args, capture_output=True, text=True, timeout=300)
    if expect_ok and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def losses(out):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step +(\d+)/\d+ +loss (\S+)", out)}


def case(name, fn):
    start = time.time()
    try:
        fn()
        cases.append((name, time.time() - start, None))
    except Exception as e:  # noqa: BLE001 - every failure becomes a report
        cases.append((name, time.time() - start, str(e)))


tmp = tempfile.mkdtemp(prefix="tandem-train-mpi-")
ckpt = os.path.join(tmp, "ckpt")
state = {}


def trains_and_saves():
    p = run(TINY + ["--steps", "6", "--save", ckpt, "--save-every", "3",
                    "--trace", os.path.join(tmp, "trace.json")])
    state["full"] = losses(p.stdout)
    assert sorted(state["full"]) == [1, 2, 3, 4, 5, 6], p.stdout
    assert "dp 1 x ep 2 x cp 2" in p.stdout, p.stdout
    assert os.path.exists(os.path.join(ckpt, "step-00000003", "checkpoint.json"))
    assert float(state["full"][6]) < float(state["full"][1]), state["full"]


def resumes_bit_exact():
    p = run(TINY + ["--steps", "6", "--resume", os.path.join(ckpt, "step-00000003")])
    got = losses(p.stdout)
    assert got == {k: v for k, v in state["full"].items() if k > 3}, (got, state["full"])


def resumes_on_another_layout():
    p = run(TINY + ["--steps", "6", "--cp", "1", "--tp", "2",
                    "--resume", os.path.join(ckpt, "step-00000003")])
    got = losses(p.stdout)
    assert abs(float(got[4]) - float(state["full"][4])) < 2e-3, (got, state["full"])


def trace_has_every_rank():
    doc = json.load(open(os.path.join(tmp, "trace.json")))
    pids = {e["pid"] for e in doc["traceEvents"]}
    cats = {e.get("cat") for e in doc["traceEvents"]}
    assert pids == {0, 1, 2, 3}, pids
    assert "comm" in cats and "coordinator" in cats, cats


def exports():
    out = os.path.join(tmp, "model.safetensors")
    p = subprocess.run([train, "export", ckpt, out], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    with open(out, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    names = [k for k in header if k != "__metadata__"]
    assert "tok_emb.weight" in names and "blocks.0.moe.experts.3.w1.weight" in names, names
    assert header["tok_emb.weight"]["shape"] == [9 * 4 + 8, 32], header["tok_emb.weight"]


def bad_layout_fails():
    p = run(TINY + ["--dp", "2"], expect_ok=False)
    assert p.returncode != 0
    assert "world size 4" in p.stderr, p.stderr


def fault(kind, expect):
    def check():
        env = dict(os.environ, TANDEM_WAIT_TIMEOUT_S="5")
        start = time.time()
        p = subprocess.run(MPI + [train] + TINY + ["--steps", "4", "--inject-fault", f"2:1:{kind}"],
                           capture_output=True, text=True, timeout=120, env=env)
        took = time.time() - start
        assert p.returncode != 0, f"{kind}: exit 0\n{p.stdout[-1000:]}"
        assert expect in p.stderr, f"{kind}: stderr lacks {expect!r}:\n{p.stderr[-3000:]}"
        assert took < 60, f"{kind}: took {took:.0f} s"
    return check


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "hf")


def llama_layouts_match_rank_threads():
    # A token file the 48-token fixtures can read (llm.c layout, uint16).
    text = b"the quick brown fox jumps over the lazy dog. a stitch in time saves nine. " * 20
    ids = [1 + b % 47 for b in text]
    data = os.path.join(tmp, "text.bin")
    with open(data, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(ids), *([0] * 253)))
        f.write(struct.pack(f"<{len(ids)}H", *ids))
    for name, layout in (("llama", ["--cp", "2", "--tp", "2", "--cp-mode", "ring",
                                    "--cp-load-balance"]),
                         ("mixtral", ["--ep", "2", "--cp", "2", "--overlap"])):
        args = ["--model", "llama", "--config", os.path.join(FIXTURES, name, "config.json"),
                "--init-from", os.path.join(FIXTURES, name), "--data", data, "--seq-len", "32",
                "--batch", "2", "--steps", "5", "--progress", "plain", "--log-every", "1"] + layout
        mpi = losses(run(["--backend", "mpi"] + args).stdout)
        p = subprocess.run([train, "--backend", "threads"] + args, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        threads = losses(p.stdout)
        assert sorted(mpi) == [1, 2, 3, 4, 5], mpi
        assert mpi == threads, f"{name}: mpirun {mpi} vs rank threads {threads}"


def zero1_and_f16():
    # ZeRO-1 over 4 dp processes: DDP's losses bit for bit; f16 with dynamic
    # loss scaling: every process skips the same overflowed steps.
    dp4 = TINY + ["--steps", "4", "--dp", "4", "--ep", "1", "--cp", "1", "--no-overlap"]
    ddp = losses(run(dp4).stdout)
    p = run(dp4 + ["--zero1"])
    assert "(ZeRO-1)" in p.stdout, p.stdout
    assert losses(p.stdout) == ddp, (losses(p.stdout), ddp)
    p = run(dp4 + ["--precision", "f16", "--loss-scale", "4194304"])
    assert "overflow: skipped" in p.stdout, p.stdout
    assert sorted(losses(p.stdout)) == [1, 2, 3, 4], p.stdout


case("trains and saves under mpirun", trains_and_saves)
case("resumes bit-exactly", resumes_bit_exact)
case("resumes on another layout", resumes_on_another_layout)
case("writes a merged trace", trace_has_every_rank)
case("exports whole tensors", exports)
case("a bad layout is a clear error", bad_layout_fails)
case("ZeRO-1 and f16 under mpirun", zero1_and_f16)
case("Llama and Mixtral under mpirun: the rank threads' losses", llama_layouts_match_rank_threads)
case("a rank that throws stops the job", fault("forward", "injected fault 'forward' on rank 2"))
case("a rank that dies stops the job", fault("exit", "the process exits now"))
case("a rank that never arrives: the watchdog fires", fault("hang", "within 5000 ms"))
shutil.rmtree(tmp, ignore_errors=True)

with open(junit, "w") as f:
    f.write('<testsuites><testsuite name="train-mpi">')
    for name, seconds, failure in cases:
        f.write(f'<testcase classname="train-mpi" name={su.quoteattr(name)} time="{seconds:.1f}">')
        if failure:
            f.write(f"<failure message={su.quoteattr(failure[:4000])}/>")
        f.write("</testcase>")
    f.write("</testsuite></testsuites>\n")
failed = [c for c in cases if c[2]]
for name, _, failure in failed:
    print(f"FAILED {name}: {failure}")
sys.exit(1 if failed else 0)
