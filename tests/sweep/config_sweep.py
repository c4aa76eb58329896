#!/usr/bin/python3
"""Random configurations through the real binary, to find the combinations no test names.

    /usr/bin/python3 tests/sweep/config_sweep.py [--seed S] [--runs N] [--parity] [--verbose] [--binary build/bin/tessera]

Each run: `plan` (sometimes `config`), then `fit` of a small model (gpt, cnn or mlp) under a random strategy, world
size (1-4, several not dividing the parameters), precision and options for 4 steps; then
`fit --ckpt-path last` for 2 more steps under another random strategy, world size and
precision; one of validate / test / predict on the checkpoint under a third; `checkpoint export`;
`fit` of a new run from its weights ([trainer] init_from) under a fourth (sometimes a GPT grown
by a block, with init_from_strict = false); sometimes `lr-find` under a fifth, and sometimes the
first fit runs it before training ([lr_find] before_fit). A command may be
refused (exit 1 with an error naming a config section or the checkpoint, as for a mesh that
does not fit the world); what counts is a CRASH: a signal, a timeout, or a failure whose error
names neither (LibTorch's own errors, internal asserts). Several ranks are started by tessera's
own launcher or, at random, by Debian's torchrun or Open MPI's mpirun. Prints each crash with
its command line and exits 1 if there was one. Not part of ctest (random by design, and
minutes: ~10 s a run on 2 cores). Fixed from what it found: 5e5cd64, 765a659, e320c2d, 3c8330e,
and (--parity) 7b6969b, 129211d.

With --parity it checks values instead of crashes: every run keeps one global batch (12 samples,
split over the data-parallel ranks) and is compared with one device on that batch: `fit` for 4
steps under a random strategy and world size, resumed for 2 more under another, against 6 steps
on one device; each logged train and val loss, the final weights (exported to .ckpt and read
with torch.load) and `validate` of the final checkpoint under a third strategy must agree
within a tolerance by precision; sometimes `lr-find` under a fourth strategy must trace one
device's loss curve. A difference is a MISMATCH.
"""
import argparse
import csv
import glob
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile

BASE = """
[trainer]
max_steps = 4
log_every_n_steps = 1
val_check_interval = 2
limit_val_batches = 2
limit_test_batches = 2
enable_progress_bar = false
seed = 1
[data]
batch_size = 4
"""


def model_options(rng, pick):
    model = pick("gpt", "cnn", "mlp")
    s = {"model.plugin": model}
    if model == "gpt":
        s.update({"data.plugin": "text", "model.n_layer": pick(1, 2), "model.n_head": pick(2, 3),
                  "model.block_size": 32, "data.block_size": 32, "model.tie_embeddings": pick("true", "false")})
        s["model.n_embd"] = s["model.n_head"] * pick(8, 10)
        if rng.random() < 0.3:  # frozen parameters; blocks.0: a unit with nothing to train
            s["trainer.freeze"] = pick('["wpe"]', '["blocks.0"]', '["wte", "blocks.0.attn"]')
    else:
        # train_limit 60 or 48: epochs end inside a run (5 or 4 steps of 12 samples)
        s.update({"data.plugin": "fashion_mnist", "data.train_limit": pick(256, 60, 48), "data.test_limit": 64,
                  "data.val_size": 64, "data.predict_limit": 8})
        if model == "cnn":
            s.update({"model.channels1": 4, "model.channels2": 8, "model.hidden": 16,
                      "model.batch_norm": pick("true", "false")})
        else:
            s["model.hidden_sizes"] = pick("[32]", "[32, 16]")
    return s


def strategy_options(rng, pick, maybe, model):
    strat = pick("fsdp", "fsdp2", "ddp", "single_device")  # offloading is refused on the CPU
    s = {"strategy.plugin": strat, "launch.devices": 1 if strat == "single_device" else pick(1, 2, 3, 4)}
    gpt = model["model.plugin"] == "gpt"
    if strat == "fsdp":
        s["strategy.sharding_strategy"] = pick("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
        if s["strategy.sharding_strategy"] == "HYBRID_SHARD" and s["launch.devices"] == 4 and maybe(0.5):
            s["strategy.hybrid_shard_group_size"] = 2
        s["strategy.auto_wrap_policy"] = pick("transformer", "size", "none") if gpt else pick("size", "none")
        if s["strategy.auto_wrap_policy"] == "size":
            s["strategy.min_num_params"] = pick(10, 1000, 100000)
        if gpt and s["strategy.auto_wrap_policy"] == "transformer" and maybe():
            s["strategy.activation_checkpointing"] = '["Block"]'
        for key, values in (("backward_prefetch", ("BACKWARD_PRE", "BACKWARD_POST", "none")),
                            ("forward_prefetch", ("true", "false")), ("limit_all_gathers", ("true", "false")),
                            ("reduce_every_micro_batch", ("true",)), ("rank0_only", ("true", "false"))):
            if maybe():
                s["strategy." + key] = pick(*values)
        if maybe():
            s["strategy.ignored_modules"] = '["ln_f"]' if gpt else '["head"]'
        elif maybe():
            s["strategy.deferred_init"] = "true"
        if maybe():
            s["strategy.state_dict_type"] = pick("sharded", "sharded", "local")
            s["checkpoint_io.plugin"] = "distributed"
    if strat == "fsdp2":
        if gpt and s["launch.devices"] in (2, 4) and maybe(0.5):
            s["strategy.tensor_parallel_size"] = 2
        if s["launch.devices"] == 4 and maybe():
            s["strategy.data_parallel_replicate_size"] = 2
        s["strategy.parallelize_fn"] = pick("transformer", "none") if gpt else "none"
        s["strategy.reshard_after_forward"] = pick("true", "false", "true", 2)  # 2: backward gathers within pairs
        if maybe(0.2):
            s["strategy.mp_policy.reduce_dtype"] = pick("float32", "bfloat16")
        for key, values in (("forward_prefetch", ("true", "false")), ("backward_prefetch", ("true", "false")),
                            ("deferred_init", ("true",))):
            if maybe():
                s["strategy." + key] = pick(*values)
        if gpt and s["strategy.parallelize_fn"] == "transformer" and maybe():
            s["strategy.activation_checkpointing"] = '["Block"]'
        if maybe():
            s["strategy.state_dict_type"] = "sharded"
            s["checkpoint_io.plugin"] = "distributed"
    if strat != "single_device" and model.get("model.batch_norm") == "true" and maybe(0.5):
        s["trainer.sync_batchnorm"] = "true"
    s["precision.precision"] = pick("32-true", "bf16-mixed", "bf16-true")
    if strat.startswith("fsdp") and maybe(0.5):
        s["precision.plugin"] = "fsdp-precision"
        if maybe():
            s["precision.reduce_dtype"] = pick("float32", "bfloat16")
        if maybe():
            s["precision.keep_low_precision_grads"] = "true"
    if s["precision.precision"] == "bf16-mixed" and maybe(0.2):
        s["precision.scaler"] = "true"
    if "checkpoint_io.plugin" not in s:
        s["checkpoint_io.plugin"] = pick("torch", "distributed")
    if maybe(0.2):
        s["checkpoint_io.async"] = "true"
    return s


def trainer_options(rng, pick, maybe):
    s = {"optimizer.name": pick("adamw", "adam", "sgd")}
    if maybe():
        s["trainer.accumulate_grad_batches"] = pick(2, 3)
    if maybe():
        s["trainer.gradient_clip_val"] = 0.5
        s["trainer.gradient_clip_algorithm"] = pick("norm", "value")
    if maybe(0.2):
        s["trainer.detect_anomaly"] = "true"
    if maybe(0.25):  # epochs of 3 batches, or half the data: they end inside a run and a resume
        s["trainer.limit_train_batches"] = pick(3, 0.5)
    if maybe(0.25):  # validation at a fraction of an epoch, at its end, or every 3 steps
        s["trainer.val_check_interval"] = pick(0.5, 1.0, 3)
    if maybe(0.2):
        s["callbacks.model_checkpoint.monitor"] = '"val_loss"'
        s["callbacks.model_checkpoint.save_top_k"] = 2
        s["callbacks.model_checkpoint.save_last"] = "true"
    if maybe(0.25):  # validated on, saved and resumed with every strategy's shards
        s["callbacks.averaging.plugin"] = pick('"ema_weight_averaging"', '"weight_averaging"')
        if s["callbacks.averaging.plugin"] == '"ema_weight_averaging"':
            s["callbacks.averaging.decay"] = pick(0.5, 0.9)
        if maybe():
            s["callbacks.averaging.update_starting_at_step"] = pick(1, 3)
    return s


def data_parallel_size(options):
    devices = int(options["launch.devices"])
    return devices // int(options.get("strategy.tensor_parallel_size", 1))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_checkpoint(root):
    """The newest run's `last` checkpoint (a resumed run writes the next version_N)."""
    versions = glob.glob(os.path.join(root, "version_*"))
    newest = max(versions, key=lambda v: int(v.rsplit("_", 1)[1]))
    return os.path.join(newest, "checkpoints", "last")


def losses(root):
    """{(step, metric): value} for every train_loss and val_loss logged under root."""
    found = {}
    for path in sorted(glob.glob(os.path.join(root, "version_*", "metrics.csv"))):
        with open(path) as f:
            for row in csv.DictReader(f):
                if row["metric"] in ("train_loss", "val_loss"):
                    found[(int(row["step"]), row["metric"])] = float(row["value"])
    return found


def weights_difference(run, binary, checkpoint, baseline, work):
    """Largest |a - b| / (1 + |b|) over the exported model weights of two checkpoints (None if an export failed)."""
    import torch  # Debian's python3-torch; only --parity needs it
    states = []
    for i, path in enumerate((checkpoint, baseline)):
        exported = os.path.join(work, f"weights-{i}.ckpt")
        if run("export", [binary, "checkpoint", "export", path, "--to", exported]) != 0:
            return None
        states.append(torch.load(exported)["state_dict"])
    if states[0].keys() != states[1].keys():
        return float("inf")
    return max(((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()
               for a, b in ((states[0][k], states[1][k]) for k in states[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--verbose", action="store_true", help="also print each refusal's error")
    parser.add_argument("--parity", action="store_true", help="compare values with one device instead of looking for crashes")
    parser.add_argument("--binary", default=os.path.join(os.path.dirname(__file__), "../../build/bin/tessera"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pick = lambda *choices: rng.choice(choices)  # noqa: E731
    maybe = lambda p=0.3: rng.random() < p  # noqa: E731
    work = tempfile.mkdtemp(prefix="tessera-sweep-")
    config = os.path.join(work, "base.toml")
    with open(config, "w") as f:
        f.write(BASE)
    counts = {"ok": 0, "refused": 0, "CRASH": 0, "MISMATCH": 0}
    launchers, launched = ["tessera", "tessera"], {}
    compared = {"losses": 0, "validate": 0, "weights": 0}  # --parity: values checked against one device
    if subprocess.run(["/usr/bin/python3", "-c", "import torch.distributed.run"], capture_output=True).returncode == 0:
        launchers.append("torchrun")
    if shutil.which("mpirun"):
        launchers.append("mpirun")
        os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # CI containers run as root

    def run(label, argv):
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            rc, out = 124, "timed out after 300 s"
        # A refusal names what to change: a config section or a checkpoint. LibTorch's own errors
        # (an internal assert, "Exception raised from", a dtype or shape it cannot handle) do not.
        refusal = re.search(r"tessera[a-z ]*: error: .*(\[[a-z_.]+\]|checkpoint)", out)
        libtorch = any(s in out for s in ("INTERNAL ASSERT", "please report a bug", "Exception raised from"))
        outcome = "ok" if rc == 0 else "refused" if rc == 1 and refusal and not libtorch else "CRASH"
        counts[outcome] += 1
        if outcome == "refused" and args.verbose:
            print(f"refused {label}: " + next(l for l in out.splitlines() if ": error: " in l)[:400], flush=True)
        if outcome == "CRASH":
            lines = [l for l in out.splitlines() if "error" in l or "signal" in l or "timed out" in l] or out.splitlines()
            print(f"CRASH {label} (exit {rc}): {' '.join(argv)}\n    " + "\n    ".join(lines[-4:]), flush=True)
        return rc

    def sets(options):
        return [arg for key, value in options.items() for arg in ("--set", f"{key}={value}")]

    def tessera(command, options, *extra):
        """argv of `tessera COMMAND`; several ranks are started by its own launcher, or at random by
        Debian's torchrun or Open MPI's mpirun where installed."""
        argv = [args.binary, command, *extra, *sets(options)]
        devices = int(options.get("launch.devices", 1))
        launcher = pick(*launchers) if devices > 1 else "tessera"
        launched[launcher] = launched.get(launcher, 0) + 1
        if launcher == "torchrun":  # 1.13 on Python 3.11 crashes with its default --redirects/--tee
            return ["/usr/bin/python3", "-m", "torch.distributed.run", f"--nproc_per_node={devices}", "--redirects", "2",
                    "--tee", "2", f"--master_port={free_port()}", "--no_python", *argv]
        if launcher == "mpirun":
            return ["mpirun", "-np", str(devices), "--oversubscribe", "-x", f"MASTER_PORT={free_port()}", *argv]
        return argv

    def crash_run(i, common, root):
        model = model_options(rng, pick)
        first = {**model, **strategy_options(rng, pick, maybe, model), **trainer_options(rng, pick, maybe)}
        if maybe(0.15):  # the range test first, then training with its lr
            first.update({"lr_find.before_fit": "true", "lr_find.num_training": 12})
        run(f"{args.seed}-{i} plan", [args.binary, "plan", *common, *sets(first), *pick([], ["--json"])])
        if maybe(0.3):
            run(f"{args.seed}-{i} config", [args.binary, "config", *common, *sets(first)])
        if run(f"{args.seed}-{i} fit", tessera("fit", first, *common)) != 0:
            return
        keep = {k: v for k, v in first.items() if k.startswith(("model.", "data.", "optimizer.", "trainer.freeze"))}
        resumed = {**keep, **strategy_options(rng, pick, maybe, model), "trainer.max_steps": 6}
        run(f"{args.seed}-{i} resume", tessera("fit", resumed, *common, "--ckpt-path", "last"))
        checkpoint = last_checkpoint(root)
        command = pick("validate", "test", "predict")
        run(f"{args.seed}-{i} {command}",
            tessera(command, {**keep, **strategy_options(rng, pick, maybe, model)}, *common, "--ckpt-path", checkpoint))
        run(f"{args.seed}-{i} export", [args.binary, "checkpoint", "export", checkpoint, "--to", os.path.join(root, "m.safetensors")])
        # Fine-tuning from those weights ([trainer] init_from) under a fourth strategy, in a new run.
        tuned = {**keep, **strategy_options(rng, pick, maybe, model), "trainer.max_steps": 2,
                 "trainer.init_from": pick(checkpoint, os.path.join(root, "m.safetensors")),
                 "trainer.default_root_dir": root + "-tuned"}
        if "model.n_layer" in keep and maybe(0.3):  # a deeper model: its new block keeps its initialisation
            tuned.update({"model.n_layer": keep["model.n_layer"] + 1, "trainer.init_from_strict": "false"})
        run(f"{args.seed}-{i} init_from", tessera("fit", tuned, *common))
        shutil.rmtree(root + "-tuned", ignore_errors=True)
        if maybe(0.4):  # the learning-rate range test under a fifth
            found = {**keep, **strategy_options(rng, pick, maybe, model), "lr_find.num_training": pick(12, 30),
                     "lr_find.max_lr": pick(0.1, 1000), "lr_find.mode": pick("exponential", "linear")}
            run(f"{args.seed}-{i} lr-find", tessera("lr-find", found, *common))

    def parity_run(i, common, root):
        model = model_options(rng, pick)
        shared = {**model, **trainer_options(rng, pick, maybe), "precision.precision": pick("32-true", "32-true", "bf16-mixed", "bf16-true"),
                  # a schedule that does not depend on max_steps, which differs between fit and resume
                  "lr_scheduler.schedule": "constant", "lr_scheduler.warmup_steps": pick(0, 3)}
        shared.pop("precision.scaler", None)

        def strategy():
            s = {**strategy_options(rng, pick, maybe, model), **shared}
            if model.get("model.batch_norm") == "true":
                s["trainer.sync_batchnorm"] = "true"  # per-rank statistics differ from one device's by design
            return {**s, "data.batch_size": 12 // data_parallel_size(s)}

        first, resumed = strategy(), {**strategy(), "trainer.max_steps": 6}
        baseline = {**shared, "strategy.plugin": "single_device", "launch.devices": 1, "data.batch_size": 12,
                    "trainer.max_steps": 6}
        reference = ["--set", f"trainer.default_root_dir={root}-one"]
        if (run(f"{args.seed}-{i} one device", [args.binary, "fit", "--config", config, *reference, *sets(baseline)])
                or run(f"{args.seed}-{i} fit", tessera("fit", first, *common))
                or run(f"{args.seed}-{i} resume", tessera("fit", resumed, *common, "--ckpt-path", "last"))):
            return
        # `validate` of the final checkpoint under a third strategy: the one device's last val_loss
        validated = {k: v for k, v in strategy().items() if k != "trainer.max_steps"}
        if run(f"{args.seed}-{i} validate", tessera("validate", validated, "--config", config, "--set",
                                                   f"trainer.default_root_dir={root}-validate", "--ckpt-path", last_checkpoint(root))):
            return
        loose = shared["precision.precision"] != "32-true" or any(
            "bfloat16" in str(v) for v in (*first.values(), *resumed.values(), *validated.values()))
        tolerance = 3e-2 if loose else 2e-4
        expected, found = losses(root + "-one"), losses(root)
        if (6, "val_loss") in expected:  # not when an epoch of 5 steps moved the val checks
            expected[(6, "validate")] = expected[(6, "val_loss")]
            found[(6, "validate")] = losses(root + "-validate").get((0, "val_loss"))
        compared["losses"] += len(expected)
        compared["validate"] += (6, "validate") in expected
        wrong = [f"{metric} at step {step}: {found.get((step, metric))} vs {value} on one device"
                 for (step, metric), value in sorted(expected.items())
                 if abs((found.get((step, metric)) or float("inf")) - value) > tolerance * abs(value)]
        crashes = counts["CRASH"]
        difference = weights_difference(run, args.binary, last_checkpoint(root), last_checkpoint(root + "-one"), root)
        compared["weights"] += difference is not None
        if difference is not None and difference > tolerance * 5:
            wrong.append(f"final weights differ by {difference:.2g} (relative)")
        commands = f"\n  fit:    {' '.join(sets(first))}\n  resume: {' '.join(sets(resumed))}"
        if counts["CRASH"] > crashes:  # (a refused export, of a rank-local checkpoint, is no crash)
            print(f"  (the export above: {args.seed}-{i}){commands}", flush=True)
        if wrong:
            counts["MISMATCH"] += 1
            print(f"MISMATCH {args.seed}-{i}:{commands}\n    " + "\n    ".join(wrong[:6]), flush=True)
        if maybe(0.4):  # lr-find under a fourth strategy: one device's loss curve
            finder = {"lr_find.num_training": 12, "lr_find.max_lr": 0.1}
            if not (run(f"{args.seed}-{i} lr-find one device", [args.binary, "lr-find", "--config", config, "--set",
                                                             f"trainer.default_root_dir={root}-lr-one", *sets({**baseline, **finder})])
                    or run(f"{args.seed}-{i} lr-find", tessera("lr-find", {**strategy(), **finder}, "--config", config,
                                                               "--set", f"trainer.default_root_dir={root}-lr"))):
                curve = lambda r: [float(row["loss"]) for row in csv.DictReader(open(glob.glob(r + "/version_0/lr_find.csv")[0]))]  # noqa: E731
                expected, found = curve(root + "-lr-one"), curve(root + "-lr")
                compared["losses"] += len(expected)
                if len(found) != len(expected) or any(abs(a - b) > tolerance * abs(b) for a, b in zip(found, expected)):
                    counts["MISMATCH"] += 1
                    print(f"MISMATCH {args.seed}-{i} lr-find: {found} vs {expected} on one device", flush=True)
        for suffix in ("-one", "-validate", "-lr-one", "-lr"):
            shutil.rmtree(root + suffix, ignore_errors=True)

    for i in range(args.runs):
        root = os.path.join(work, str(i))
        (parity_run if args.parity else crash_run)(i, ["--config", config, "--set", f"trainer.default_root_dir={root}"], root)
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    mismatches = (f", {counts['MISMATCH']} runs differ from one device (compared: {compared['losses']} losses, "
                  f"{compared['validate']} validate runs, {compared['weights']} final weights)") if args.parity else ""
    starters = ", ".join(f"{name} {n}" for name, n in sorted(launched.items()))
    print(f"seed {args.seed}: {sum(counts.values())} commands, {counts['ok']} ok, {counts['refused']} refused "
          f"with an error, {counts['CRASH']} crashed{mismatches}; commands by launcher: {starters}")
    sys.exit(1 if counts["CRASH"] or counts["MISMATCH"] else 0)


if __name__ == "__main__":
    main()
