"""The README's first command for every speculative method, in one process: tok/s on this machine (the CPU).

    python tools/cpu_speed.py [--rounds 3] [--max-tokens 64] [--concurrency 4] [--serve N [--serve-dataset held-out]
        [--serve-temperature 0]]

Each method decodes "def fib(n):" greedily (as `python specdec.py --prompt "def fib(n):" --max-tokens 64
[--speculative-config ...]` does, on the shipped toy model), its rate measured as the CLI measures it: tokens
after the first over the time after the first. The methods take turns over --rounds rounds (so a burst of load
from elsewhere hits all of them) and each keeps its median. Then --concurrency requests at once (four prompts,
64 tokens each; output tokens over wall time), speculation off against MTP k=3. With --serve N: `bench.py serve`
(--num-prompts N, --max-concurrency --concurrency, --gen-len 64, --ignore-eos; random prompts of 256 tokens)
against `server.py` on the toy model, started once without speculation and once with MTP k=3 (output token
throughput, MTP's mean acceptance length). Its
prompts: random token ids (bench.py serve's default, vLLM's random dataset), which the toy model was not trained
on, or with --serve-dataset held-out the code prompts of tools/eval_toy.py (128-token windows of the held-out
stdlib files in models/train_log.json, as text), written to a temporary JSONL for `--dataset-name custom`.
Unlike the rows above these are sampled, at the server's default temperature (1.0: the toy's generation_config
sets only do_sample, which vLLM does not read), so the acceptance there is below eval_toy.py's greedy one;
--serve-temperature 0 sends greedy requests instead.
Prints the load average and the CPU (its model name and torch's kernel level, AVX2 or AVX512), a markdown table
with the ratios to speculation off, then one JSON line.
"""
import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import specdec as sd  # noqa: E402
import torch  # noqa: E402
from eval_toy import held_out_prompts  # noqa: E402  (this folder: sys.path[0] when run as a script)

M = os.path.join(ROOT, "models")
METHODS = {
    "off": None,
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "dflash k=7": {"method": "dflash", "model": os.path.join(M, "toy-dflash"), "num_speculative_tokens": 7},
    # its block's first 3 drafts: a CPU verify costs by the row, and late drafts are accepted least (session 21's
    # drafters never had drafts 4-7 accepted on "def fib(n):"; session 22's: k=3 1.32-1.64x, k=7 1.29-1.55x)
    "dflash k=3": {"method": "dflash", "model": os.path.join(M, "toy-dflash"), "num_speculative_tokens": 3},
    "dspark": {"method": "dspark", "model": os.path.join(M, "toy-dspark"), "num_speculative_tokens": 8},
    "draft_model k=4": {"method": "draft_model", "model": os.path.join(M, "toy-draft"), "num_speculative_tokens": 4},
    # two drafts: each is a pass of the 2-layer draft model, which on a CPU costs ~a quarter of a target step
    # (session 50, the AVX2 EPYC, one process: k = 1 / 2 / 3 / 4 1.19 / 1.26 / 1.24 / 1.16x)
    "draft_model k=2": {"method": "draft_model", "model": os.path.join(M, "toy-draft"), "num_speculative_tokens": 2},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
}
PROMPTS = ["def fib(n):", "import os\n\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
           "def parse_args(argv):"]


def one(llm, prompt, n):
    """The CLI's rate: (tokens - 1) / (time after the first token); and the tokens."""
    eng = llm.engine
    req = eng.add_request(llm.tokenizer.encode(prompt), sd.SamplingParams(temperature=0.0, max_tokens=n))
    while not req.finished:
        eng.step()
    t1 = time.perf_counter()
    return (len(req.output_ids) - 1) / (t1 - req.first_token_time), list(req.output_ids)


def many(llm, n):
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, sd.SamplingParams(temperature=0.0, max_tokens=n))
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def cpu_name():
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string: the CPU class varies between
    runs of the same machine kind (an AVX-512 Zen 5, an AVX2 EPYC), and the rows with it."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


def spread(xs):
    """A measurement's rounds as "min-max" tok/s."""
    return f"{min(xs):.0f}-{max(xs):.0f}"


def write_held_out(tok, n, path):
    """tools/eval_toy.py's held-out code prompts (128 tokens each, at most n) as a custom-dataset JSONL of their
    text; -> how many. bench.py serve sends text, which the server encodes again (a window's edge could merge
    differently; on the shipped tokenizer all 16 come back as the same 128 tokens)."""
    prompts = held_out_prompts(tok, n, 128, M)
    with open(path, "w", encoding="utf-8") as fh:
        for ids in prompts:
            fh.write(json.dumps({"prompt": tok.decode(ids)}) + "\n")
    return len(prompts)


def serve(spec, n, concurrency, dataset=None, temperature=None):
    """bench.py serve's output token throughput against a fresh server.py (spec: None or a JSON string), and
    its mean acceptance length (None without speculation). dataset: None for bench.py serve's random token ids
    (as vllm bench serve's random dataset), which the toy model was not trained on: its drafts are rarely
    accepted there (session 13: MTP k=3 acceptance length 1.22, against 2.7 on code); or a custom JSONL's path.
    temperature: sent with every request (None: the server's default, 1.0 for the toy)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.join(ROOT, "server.py"), "--port", str(port), "--device", "cpu",
           "--max-num-seqs", str(concurrency)] + (["--speculative-config", spec] if spec else [])
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "serve", "--url",
                              f"http://127.0.0.1:{port}", "--num-prompts", str(n), "--max-concurrency",
                              str(concurrency), "--gen-len", "64", "--ignore-eos"]
                             + ([] if dataset else ["--random-input-len", "256"])  # (bench.py serve's old default)
                             + (["--dataset-name", "custom", "--dataset-path", dataset] if dataset else [])
                             + ([] if temperature is None else ["--temperature", str(temperature)]),
                             capture_output=True, text=True)
        if out.returncode:  # bench.py's own message (its `error:` line), not a bare CalledProcessError
            raise SystemExit(f"bench.py serve failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        return res["output_throughput"], res.get("spec_decode_acceptance_length")
    finally:
        srv.terminate()
        srv.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--serve", type=int, default=0, help="bench.py serve with this many prompts (0: skip)")
    ap.add_argument("--serve-dataset", choices=["random", "held-out"], default="random",
                    help="--serve's prompts: random token ids, or eval_toy.py's held-out code (cycled up to N)")
    ap.add_argument("--serve-temperature", type=float, default=None,
                    help="--serve's requests' temperature (0: greedy, as the rows above; default: the server's, 1.0)")
    a = ap.parse_args()
    load0 = os.getloadavg()
    llms = {k: sd.LLM(model=os.path.join(M, "toy"), speculative_config=v, device="cpu",
                      max_num_seqs=a.concurrency) for k, v in METHODS.items()}
    for llm in llms.values():
        one(llm, PROMPTS[0], 8)  # warm-up
    rates, toks = {k: [] for k in llms}, {}
    for _ in range(a.rounds):
        for k, llm in llms.items():
            r, toks[k] = one(llm, PROMPTS[0], a.max_tokens)
            rates[k].append(r)
    conc = {k: [] for k in ("off", "mtp k=3")}
    for _ in range(a.rounds):
        for k in conc:
            conc[k].append(many(llms[k], a.max_tokens))
    served, n_held_out = {}, None
    if a.serve:
        with tempfile.TemporaryDirectory() as tmp:
            dataset = None
            if a.serve_dataset == "held-out":
                dataset = os.path.join(tmp, "held_out.jsonl")
                n_held_out = write_held_out(llms["off"].tokenizer, a.serve, dataset)
            served = {"off": serve(None, a.serve, a.concurrency, dataset, a.serve_temperature),
                      "mtp k=3": serve(json.dumps(METHODS["mtp k=3"]), a.serve, a.concurrency, dataset,
                                       a.serve_temperature)}
    load1 = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rates.items()}
    cmed = {k: statistics.median(v) for k, v in conc.items()}
    print(f"load average (1, 5, 15 min) before: {load0}, after: {load1}; {os.cpu_count()} CPUs, {cpu_name()} "
          f"(torch's CPU kernels: {torch.backends.cpu.get_cpu_capability()})")
    print("| method | tok/s (median of %d) | rounds (min-max) | vs off | tokens == off |" % a.rounds)
    print("|---|---|---|---|---|")
    for k in llms:
        same = toks[k] == toks["off"]
        print(f"| {k} | {med[k]:.1f} | {spread(rates[k])} | {med[k] / med['off']:.2f}x | {same} |")
    print(f"| concurrency {a.concurrency} off | {cmed['off']:.1f} | {spread(conc['off'])} | | |")
    print(f"| concurrency {a.concurrency} mtp k=3 | {cmed['mtp k=3']:.1f} | {spread(conc['mtp k=3'])} | "
          f"{cmed['mtp k=3'] / cmed['off']:.2f}x | |")
    if served:
        (off, _), (mtp, length) = served["off"], served["mtp k=3"]
        what = "random token ids" if n_held_out is None else f"{n_held_out} held-out code prompts"
        if a.serve_temperature is not None:
            what += f", temperature {a.serve_temperature:g}"
        print(f"| bench.py serve ({what}), concurrency {a.concurrency}, off | {off:.1f} | | | |")
        print(f"| bench.py serve ({what}), concurrency {a.concurrency}, mtp k=3 (acceptance length {length:.2f}) | "
              f"{mtp:.1f} | | {mtp / off:.2f}x | |")
    print(json.dumps({"serve_dataset": a.serve_dataset if served else None, "serve_held_out_prompts": n_held_out,
                      "serve_temperature": a.serve_temperature if served else None,
                      "serve_output_tok_s": {k: v[0] for k, v in served.items()},
                      "serve_acceptance_length": {k: v[1] for k, v in served.items()}, "load_before": load0,
                      "load_after": load1, "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "tok_s": med, "rounds": rates,
                      "concurrency": a.concurrency, "concurrent_tok_s": cmed,
                      "same_tokens": {k: toks[k] == toks["off"] for k in llms}}))


if __name__ == "__main__":
    main()
