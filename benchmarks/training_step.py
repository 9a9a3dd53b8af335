"""One training step of a GPT-2-small-shaped random model: mha against torch eager.

    python benchmarks/training_step.py [--threads 2] [--rounds 3] [--batch 4] [--tokens 128]
                                       [--layers 12] [--cases mha mha+torch torch] [--json FILE]

One step = forward, next-token cross-entropy, every parameter's gradient, and an AdamW update
(lr 1e-4, weight decay 0.01), float32, on ``--threads`` threads, for a random model of
GPT-2 small's shape (12 layers, 768 wide, 12 heads, vocab 50,257, 1,024 positions, tied
embeddings):

- ``mha``: ``mha.models.from_config`` (torch never imported), ``model.loss_and_grads(ids)``,
  then ``AdamW.step`` inside ``model.writable_parameters()`` (which packs the dense weights
  again for the GEMM);
- ``mha+torch``: the same with torch imported first (its OpenMP runtime loaded beside mha's
  threads);
- ``torch``: transformers' GPT2LMHeadModel in eager mode, ``zero_grad(set_to_none=True)``,
  ``model(ids, labels=ids).loss.backward()``, ``torch.optim.AdamW.step()``.

Each case runs in its own process: it builds its model (RSS then: "with the model"; mha's
includes the packed copies of its dense weights that its GEMM reads), builds the optimizer,
takes one untimed step, resets the peak resident set size (``/proc/self/clear_refs``), then
times ``--rounds`` steps. Reported per case: the median step and the spread (lowest and
highest); the memory of a step over the model, peak RSS during the timed steps minus RSS
with the model (Linux's VmHWM and VmRSS, measured the same way for every case; the
optimizer's moments, the gradients and the activations all count); and the loss of the
first step. The cases run one
after the other, so a loaded machine shows up in the spread.
"""
import argparse
import json
import subprocess
import sys
import time

CASES = ("mha", "mha+torch", "torch")
CONFIG = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "vocab_size": 50257,
          "n_positions": 1024}


def _status(field):
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                        # resets VmHWM to the current RSS


def run_case(case, threads, rounds, batch, tokens, layers):
    """Run one case in this process -> its figures."""
    import numpy as np
    ids = np.random.default_rng(1).integers(0, CONFIG["vocab_size"], size=(batch, tokens))
    config = dict(CONFIG, n_layer=layers)
    if case == "torch":
        import torch
        import transformers
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
        weights = _status("VmRSS")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        ids_t = torch.from_numpy(ids)

        def step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids_t, labels=ids_t).loss
            loss.backward()
            optimizer.step()
            return float(loss.detach())
    else:
        if case == "mha+torch":
            import torch
            torch.set_num_threads(threads)
        import mha
        import mha.models
        from mha import train
        mha.set_num_threads(threads)
        model = mha.models.from_config(config, seed=0)
        weights = _status("VmRSS")
        optimizer = train.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

        def step():
            loss, grads = model.loss_and_grads(ids)
            with model.writable_parameters():
                optimizer.step(grads)
            return loss
    loss = step()                                               # untimed: warm up
    _reset_peak()
    base = _status("VmRSS")
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(case=case, median=float(np.median(times)), low=min(times), high=max(times),
                loss=loss, rss_model=weights, peak_over_model=_status("VmHWM") - weights,
                peak_over_step_start=_status("VmHWM") - base)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--one", choices=CASES, help=argparse.SUPPRESS)   # the child process
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    sizes = (args.threads, args.rounds, args.batch, args.tokens, args.layers)
    if args.one:
        print(json.dumps(run_case(args.one, *sizes)))
        return
    results = []
    for case in args.cases:
        child = subprocess.run(
            [sys.executable, __file__, "--one", case, "--threads", str(args.threads),
             "--rounds", str(args.rounds), "--batch", str(args.batch), "--tokens",
             str(args.tokens), "--layers", str(args.layers)],
            check=True, capture_output=True, text=True)
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"GPT-2-shaped, {args.layers} layers x 768, vocab 50257; {args.batch} x {args.tokens} "
          f"tokens; forward + backward + AdamW, float32; {args.threads} threads; "
          f"{args.rounds} rounds")
    mb = 2.0 ** 20
    for r in results:
        print(f"  {r['case']:9s} step {r['median']:.3f} s (spread {r['low']:.3f} - "
              f"{r['high']:.3f})  RSS with the model {r['rss_model'] / mb:.0f} MB, peak of a "
              f"step over it {r['peak_over_model'] / mb:.0f} MB  loss {r['loss']:.4f}")
    by_case = {r["case"]: r for r in results}
    if "torch" in by_case:
        for case in ("mha", "mha+torch"):
            if case in by_case:
                ours, torch = by_case[case], by_case["torch"]
                print(f"  torch / {case}: {torch['median'] / ours['median']:.2f}x time; "
                      f"{case} / torch: "
                      f"{ours['peak_over_model'] / torch['peak_over_model']:.2f}x memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
