"""Single-process unit tests: config, ledger arithmetic, data, chunking, sizes, model."""
import math
import threading

import pytest
import torch

from lowcomm.tools.bench import parse_size
from lowcomm.comm.collectives import chunk_bounds
from lowcomm.run.config import Config, ConfigError, parse_override
from lowcomm.run.api import load_config
from lowcomm.tasks.corpus import Corpus
from lowcomm.comm.ledger import Ledger, busbw_factor, wire_bytes
from lowcomm.tasks.tinygpt import TinyGPT
from lowcomm.run.schedule import lr_at


# config -----------------------------------------------------------------------------------------
def test_defaults_validate_and_overrides_are_typed():
    cfg = load_config(None, ["steps=7", "lr=1e-2", "strategy.overlap=false", "strategy.algorithm=ring",
                             "strategy.bucket_mb=2"])
    assert (cfg.steps, cfg.lr, cfg.strategy["overlap"], cfg.strategy["algorithm"]) == (7, 0.01, False, "ring")
    assert cfg.strategy["bucket_mb"] == 2.0 and isinstance(cfg.strategy["bucket_mb"], float)
    assert Config().method == "syncdp(mpi)"


@pytest.mark.parametrize("override,key", [
    ("stepz=3", "stepz"), ("strategy.nme=x", "strategy.nme"), ("steps=1.5", "steps"),
    ("strategy.overlap=3", "strategy.overlap"), ("lr=-1", "lr"), ("steps=0", "steps"),
    ("model.n_heads=3", "model.n_heads"), ("optimizer.name=lion", "optimizer.name"),
    ("steps.x=1", "steps.x"), ("data.path=/no/such/dir", "data.path"), ("topology=dc:0", "topology"),
    ("strategy.backend=nccl", "strategy.backend"), ("noequals", "noequals"),
    ("comm.timeout_s=-1", "comm.timeout_s"), ("optimizer.schedule=step", "optimizer.schedule"),
    ("comm.watchdog_factor=-2", "comm.watchdog_factor"), ("comm.outage_s=inf", "comm.outage_s"),
    ("optimizer.warmup_steps=300", "optimizer.warmup_steps"),
    ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
    ("checkpoint.format=safetensors", "checkpoint.format"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.key == key and f"'{key}'" in str(e.value)


@pytest.mark.parametrize("override,key", [
    ("lr=inf", "lr"), ("lr=nan", "lr"), ("strategy.outer_lr=inf", "strategy.outer_lr"),
    ("optimizer.momentum=-inf", "optimizer.momentum"),
])
def test_a_value_that_is_not_finite_is_refused_naming_the_key(override, key):
    """inf passed the "> 0" checks and failed later, blaming the loss."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override, *(["strategy.name=diloco"] if "outer" in key else [])])
    assert e.value.key == key and "finite" in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="'policy.dc.outer_lr': must be a finite number, got inf"):
        load_config(None, ["topology=dc:2,rank:1", "policy.dc=diloco:outer_lr=inf"])


def test_a_key_given_twice_in_a_spec_string_is_refused():
    """As TOML refuses a duplicate key; the later value used to win silently."""
    from lowcomm.run.registry import parse_spec
    with pytest.raises(ConfigError, match=r"'strategy': option 'period' given twice in "
                                          r"'diloco:period=4,period=8'"):
        parse_spec("diloco:period=4,period=8")
    with pytest.raises(ConfigError, match="'policy.dc': option 'period' given twice"):
        load_config(None, ["topology=dc:2,rank:1", "policy.dc=diloco:period=4, period=8"])
    assert parse_spec("diloco:period=4,outer_lr=0.5")[1] == {"period": 4, "outer_lr": 0.5}


def test_onebit_adam_is_a_registered_strategy_and_its_old_keys_say_what_to_write():
    from lowcomm.run.registry import STRATEGIES, parse_spec, strategy_settings
    from lowcomm.strategies.optimizers.onebit_adam import METHOD, OneBitAdamSettings
    from lowcomm.tools.compare import available, methods
    assert STRATEGIES["onebit-adam"] is METHOD
    cfg = load_config(None, ["strategy.name=onebit-adam", "strategy.freeze_step=7", "optimizer.name=adam"])
    assert strategy_settings(cfg) == (METHOD, OneBitAdamSettings(freeze_step=7))
    assert parse_spec("onebit-adam:freeze_step=100") == (METHOD, {"freeze_step": 100})
    assert methods()["onebit-adam"] == ["strategy.name=onebit-adam"] and available("onebit-adam")
    load_config(None, ["strategy.name=onebit-adam"])           # AdamW, the default optimizer
    for overrides, key, says in [
            (["optimizer.name=onebit-adam"], "optimizer.name", 'strategy.name = "onebit-adam"'),
            (["optimizer.freeze_step=10"], "optimizer.freeze_step", "strategy.freeze_step = N"),
            (["strategy.name=onebit-adam", "strategy.freeze_step=0"], "strategy.freeze_step", ">= 1"),
            (["strategy.name=onebit-adam", "optimizer.name=sgd"], "optimizer.name", "Adam or AdamW"),
            (["strategy.name=onebit-adam", "compressor.name=int8"], "compressor.name", "itself"),
            (["strategy.name=onebit-adam", "strategy.backend=horovod"], "strategy.backend", "ignore"),
            (["strategy.freeze_step=10"], "strategy.freeze_step", "onebit-adam, which syncdp would ignore"),
            (["topology=dc:2,rank:2", "policy.dc=onebit-adam"], "policy.dc", "cannot be a level")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        assert e.value.key == key and says in str(e.value), (overrides, str(e.value))


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    cfg = load_config(None, ["steps=10", "lr=1.0", "optimizer.schedule=cosine",
                             "optimizer.warmup_steps=2", "optimizer.min_lr_ratio=0.1"])
    lrs = [lr_at(cfg, t) for t in range(1, 11)]
    assert lrs[:2] == [0.5, 1.0]                                   # linear warm-up
    # cosine over the 8 steps after it: t = 2 + 8·u  ->  0.1 + 0.9 · (1 + cos(pi·u)) / 2
    assert lrs[5] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * 4 / 8)) / 2)   # = 0.55
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[1:], lrs[2:]))            # decreasing after warm-up
    assert {lr_at(load_config(None, ["steps=5"]), t) for t in range(1, 6)} == {3e-3}


def test_async_ps_takes_an_lr_schedule():
    # each push carries the worker's learning rates (tests/mpi/check_optimizer.py shows that a
    # LambdaLR at 0 on the workers stops the servers' updates)
    cfg = load_config(None, ["strategy.name=async-ps", "optimizer.schedule=cosine",
                             "optimizer.warmup_steps=5"])
    assert cfg.optimizer.schedule == "cosine" and cfg.optimizer.warmup_steps == 5


def test_toml_file_nested_tables(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('steps = 5\n[strategy]\nalgorithm = "tree"\n[model]\nd_model = 64\n')
    cfg = load_config(f, ["model.d_model=32"])
    assert (cfg.steps, cfg.strategy["algorithm"], cfg.model.d_model) == (5, "tree", 32)
    f.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="'model.width': unknown key"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")


def test_parse_override_reads_toml_literals():
    assert parse_override("a=3") == ("a", 3)
    assert parse_override("a = true") == ("a", True)
    assert parse_override("a=ring") == ("a", "ring")
    assert parse_override("a='x=y'") == ("a", "x=y")


# ledger -----------------------------------------------------------------------------------------
def test_wire_bytes_and_busbw_factors_follow_nccl_tests():
    assert wire_bytes("allreduce", 1000, 4) == (1500, 1500)
    assert wire_bytes("allgather", 10, 4) == (30, 30)
    assert wire_bytes("allreduce", 1000, 1) == (0, 0)
    assert busbw_factor("allreduce.ring", 4) == 1.5
    assert busbw_factor("allgather", 4) == 0.75
    assert busbw_factor("bcast", 8) == 1.0


def test_ledger_scope_charges_nested_traffic_to_one_op_per_thread():
    led = Ledger()

    def work(i):
        with led.scope("allreduce.ring", "node"):
            for _ in range(10):
                led.record("sendrecv", "node", sent=i, recv=2 * i)
    threads = [threading.Thread(target=work, args=(i,)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = led.get("allreduce.ring", "node")
    assert (row.calls, row.bytes_sent, row.bytes_recv) == (3, 60, 120)
    assert led.get("sendrecv", "node").calls == 0
    led.record("bcast", "dc", sent=5)
    assert led.by_level() == {"node": 60, "dc": 5}
    copy = Ledger()
    copy.load_state_dict(led.state_dict())
    assert copy.rows() == led.rows()


# data and helpers -------------------------------------------------------------------------------
def test_chunk_bounds_cover_exactly():
    for n in (0, 1, 5, 1000):
        for k in (1, 3, 4, 7):
            b = chunk_bounds(n, k)
            sizes = [b[i + 1] - b[i] for i in range(k)]
            assert b[0] == 0 and b[-1] == n and max(sizes) - min(sizes) <= 1


def test_parse_size():
    assert [parse_size(s) for s in ("4K", "1M", "16M", "100", "1.5K", "2MiB")] == \
        [4096, 1 << 20, 16 << 20, 100, 1536, 2 << 20]
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size("lots")


@pytest.fixture(scope="module")
def corpus():
    return Corpus.load(max_bytes=600_000)


def test_stdlib_corpus_is_real_split_and_deterministic(corpus):
    assert corpus.files > 10 and len(corpus.train) > 100_000 and len(corpus.eval) > 1000
    assert b"def " in bytes(corpus.train[:200_000].tolist())
    again = Corpus.load(max_bytes=600_000)
    assert torch.equal(again.train, corpus.train) and torch.equal(again.eval, corpus.eval)


def test_batches_are_a_function_of_step_and_rank(corpus):
    x, y = corpus.batch(3, 1, 4, 8, 32, seed=5)
    x2, y2 = corpus.batch(3, 1, 4, 8, 32, seed=5)
    assert x.shape == (8, 32) and torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])                     # next-byte targets
    assert not torch.equal(x, corpus.batch(4, 1, 4, 8, 32, seed=5)[0])
    assert not torch.equal(x, corpus.batch(3, 2, 4, 8, 32, seed=5)[0])


def test_text_file_as_data(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) * 100)
    c = Corpus.load(str(f), eval_fraction=0.1)
    assert len(c.train) + len(c.eval) == 25_600


def test_tinygpt_is_causal():
    torch.manual_seed(0)
    m = TinyGPT(seq_len=16, d_model=32, n_layers=1, n_heads=4)
    x = torch.randint(0, 256, (2, 16))
    out = m(x)
    assert out.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10:] = 0
    assert torch.allclose(m(x2)[:, :10], out[:, :10], atol=1e-6)   # the future does not leak


# watchdog ---------------------------------------------------------------------------------------
def test_watchdog_fires_only_on_a_call_past_its_timeout(capsys):
    import time

    from lowcomm.comm.watchdog import Watchdog
    fired = threading.Event()
    dog = Watchdog(0.3, rank=5, abort=fired.set)
    describe = lambda: ("allreduce.ring (64 bytes)", "rank 4 of level world")  # noqa: E731
    with dog.watch(describe):
        time.sleep(0.05)
    time.sleep(0.4)
    assert not fired.is_set()
    with dog.watch(describe):
        assert fired.wait(3)
    err = capsys.readouterr().err
    assert "rank 5 waited" in err and "allreduce.ring" in err and "rank 4 of level world" in err
    with pytest.raises(ValueError):
        Watchdog(-1, 0)


def test_watchdog_limit_scales_with_the_alpha_beta_prediction(capsys):
    """limit = max(floor, factor × (rounds·α + bytes_sent/β)) + outage_s on a wide-area link;
    a long transfer on a slow link is let finish, a hang on a fast link still ends the job."""
    import time

    from lowcomm.comm.topology import LinkModel
    from lowcomm.comm.watchdog import Watchdog
    wan = LinkModel(25e-3, 100e6 / 8)          # 25 ms, 100 Mbit/s: between datacenters
    lan = LinkModel(2e-6, 5e9)                 # inside a node
    dog = Watchdog(60, rank=2, factor=10, outage_s=30, abort=lambda: None)
    n = 100 << 20                              # 100 MiB per rank, all-reduce over 4 ranks
    # by hand: the vendor all-reduce sends 2(K-1)/K·n = 1.5·n bytes in 2·log2(4) = 4 rounds
    wan_s = 4 * 25e-3 + 1.5 * n / (100e6 / 8)
    assert dog.limit("allreduce.mpi", n, 4, wan)[0] == pytest.approx(10 * wan_s + 30)
    assert dog.limit("allreduce.mpi", n, 4, lan)[0] == 60          # fast link: the floor
    assert dog.limit("allreduce.mpi", 1024, 4, wan)[0] == 90         # small op: floor + outage
    assert dog.limit("sendrecv", n, 2, wan)[0] == pytest.approx(10 * (25e-3 + n / (100e6 / 8)) + 30)
    assert dog.limit("check:allgather", 96, 4, wan)[0] == 90
    assert dog.limit("allreduce.mpi", n, 4, None)[0] == 60           # unknown link: the floor
    fixed = Watchdog(5, rank=0, factor=0, outage_s=0)                # the explicit override
    assert fixed.limit("allreduce.mpi", n, 4, wan)[0] == fixed.limit("send", 8, 2, lan)[0] == 5
    assert Watchdog(0, rank=0).limit("allreduce.mpi", n, 4, wan)[0] == 0   # off
    with pytest.raises(ValueError, match="factor"):
        Watchdog(1, 0, factor=-1)

    # live: floor 0.2 s; a 1 MB send on a 10 Mbit/s wide link is predicted 0.8 s -> limit 1.6 s
    fired = threading.Event()
    dog = Watchdog(0.2, rank=3, factor=2, outage_s=0, abort=fired.set)
    slow = LinkModel(1e-3, 10e6 / 8)
    limit, why = dog.limit("send", 10 ** 6, 2, slow)
    assert limit == pytest.approx(2 * (1e-3 + 0.8))
    describe = lambda: ("send (1000000 bytes) on level dc", "rank 1 of level dc")  # noqa: E731
    with dog.watch(describe, limit, why):
        time.sleep(0.6)                       # three floors: a fixed limit would have fired
    assert not fired.is_set()
    limit, why = dog.limit("send", 10 ** 6, 2, lan)
    with dog.watch(describe, limit, why):     # the same wait on a fast link is a hang
        assert fired.wait(3)
    err = capsys.readouterr().err
    assert "rank 3 waited" in err and "send (1000000 bytes) on level dc" in err and "(timeout 0.2 s)" in err


def test_watchdog_settings_come_from_the_environment_unless_the_config_says(monkeypatch):
    from lowcomm.errors import LowcommError
    from lowcomm.comm.watchdog import Watchdog
    monkeypatch.setenv("LOWCOMM_TIMEOUT_S", "7")
    monkeypatch.setenv("LOWCOMM_WATCHDOG_FACTOR", "3")
    monkeypatch.setenv("LOWCOMM_WATCHDOG_OUTAGE_S", "11")
    cfg = load_config(None, [])
    assert (cfg.comm.timeout_s, cfg.comm.watchdog_factor, cfg.comm.outage_s) == (7, 3, 11)
    dog = Watchdog(None, 0)
    assert (dog.timeout_s, dog.factor, dog.outage_s) == (7, 3, 11)
    cfg = load_config(None, ["comm.outage_s=2", "comm.watchdog_factor=0"])
    assert (cfg.comm.timeout_s, cfg.comm.watchdog_factor, cfg.comm.outage_s) == (7, 0, 2)
    monkeypatch.setenv("LOWCOMM_WATCHDOG_OUTAGE_S", "soon")
    with pytest.raises(LowcommError, match="LOWCOMM_WATCHDOG_OUTAGE_S='soon'"):
        load_config(None, [])


def test_a_failed_jobs_cause_carries_what_open_mpi_warned_of_and_not_its_abort_banner():
    from lowcomm.run.supervise import cause
    rule = "-" * 74
    stderr = "\n".join([
        "lowcomm watchdog: rank 3 waited 60.6 s (timeout 60 s) in op allgather.shm (0 bytes) on level rank",
        rule, "MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD", "with errorcode 3.", rule,
        rule, "WARNING: Open MPI failed to TCP connect to a peer MPI process.  This",
        "should not happen.", "", "Your Open MPI job may now hang or fail.", "",
        "  Local host: lowcomm-dc0", "  Message:    connect() to 10.77.0.2:1024 failed",
        "  Error:      Operation now in progress (115)", rule,
        "[rank 0] WARNING lowcomm.train: SIGTERM: stopping after this step"])
    why = cause(stderr, 3)
    assert why.startswith("lowcomm watchdog: rank 3 waited 60.6 s"), why
    assert ("(Open MPI said: WARNING: Open MPI failed to TCP connect to a peer MPI process. This should "
            "not happen. Local host: lowcomm-dc0 Message: connect() to 10.77.0.2:1024 failed "
            "Error: Operation now in progress (115))") in why, why
    assert "MPI_ABORT" not in why and "may now hang" not in why
    # only the abort banner: nothing is added; no stderr at all: the exit status
    assert cause("\n".join(stderr.splitlines()[:5]), 3) == stderr.splitlines()[0]
    assert cause("", 3) == "exit status 3" and cause("", -9) == "killed by SIGKILL"
    # a usage error (click's "Error: ..."), not the rule that ends mpirun's banner after it
    refused = "\n".join(["Usage: python -m lowcomm.cli [OPTIONS] COMMAND [ARGS]...", "",
                         "Error: runs/x holds another run (config.json); continue it with --resume",
                         rule, "Primary job  terminated normally, but 1 process returned", rule])
    assert cause(refused, 2) == "Error: runs/x holds another run (config.json); continue it with " \
        "--resume", cause(refused, 2)
    assert cause(f"no lowcomm line\n{rule}\n", 2) == "exit status 2: no lowcomm line"


@pytest.mark.parametrize("where, value, want", [
    (None, None, None), ("loss", float("nan"), "the loss"), ("b", float("inf"), "the gradient of 'b'"),
    ("w", float("nan"), "the gradient of 'w'"), ("w", 3e38, None)])   # 3e38 twice: the sum overflows
def test_the_loop_names_what_is_not_finite(where, value, want):
    from lowcomm.run.evaluate import nonfinite
    model = torch.nn.Linear(3, 2)
    loss = model(torch.ones(4, 3)).sum()
    loss.backward()
    if where == "loss":
        loss = loss * value
    elif where is not None:
        g = getattr(model, {"w": "weight", "b": "bias"}[where]).grad
        g[0] = value
        g[-1] = value
    got = nonfinite(loss, model)
    assert got == (want.replace("'w'", "'weight'").replace("'b'", "'bias'") if want else None), got


def test_an_idle_wait_doubles_its_sleeps_and_a_hurry_wakes_the_sleeper():
    """The reduction thread's sleeps between tests double to a cap; someone waiting for the
    result wakes it at once and makes it test every first_s."""
    import time

    from lowcomm.comm.idle import IdleWait
    idle = IdleWait(0.002, 0.032)
    assert [idle.pause(n) for n in range(7)] == [0.002, 0.004, 0.008, 0.016, 0.032, 0.032, 0.032]
    slow = IdleWait(0.002, 30.0)
    sleeper = threading.Thread(target=slow.sleep, args=(20,))      # would sleep 30 s
    t0 = time.monotonic()
    sleeper.start()
    time.sleep(0.05)
    with slow.hurry():
        sleeper.join(5.0)
        assert not sleeper.is_alive() and time.monotonic() - t0 < 5.0, "hurry() did not wake it"
        assert slow.pause(20) == 0.002
    assert slow.pause(20) == 30.0
    with pytest.raises(ValueError, match="first_s"):
        IdleWait(0.01, 0.001)
