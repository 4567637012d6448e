"""`jaxpar bench`: a section measures, prints its table and returns its numbers."""

import pytest
from helpers import jaxpar_command

from jaxpar.bench import compile as by_depth
from jaxpar.bench import context as long_sequences
from jaxpar.bench import experts, generate, hosts, measure, strategies
from jaxpar.bench.measure import Base
from jaxpar.bench.run import run_bench


@pytest.mark.slow
def test_remat_section(devices, capsys, monkeypatch):
    monkeypatch.setattr(measure, "REPEATS", 1)  # what is checked is the table, not timing
    results = run_bench(steps=2, only=["remat"])
    assert list(results) == ["remat"]
    rows = results["remat"]
    assert list(rows) == ["none", "full", "offload"]
    # gpt-tiny on data=8: 4 layers of [2 rows, 64 tokens, 64 wide] fp32 inputs
    assert rows["offload"]["report"].host_memory_per_device.activations == 4 * 2 * 64 * 64 * 4
    temp = {mode: r["report"].memory_per_device.temp for mode, r in rows.items()}
    assert temp["full"] < temp["none"]
    out = capsys.readouterr().out
    assert "parallel.remat" in out and "host activations" in out


@pytest.mark.slow
def test_context_section_measures_each_strategy_at_the_textbook_bytes(devices, capsys, monkeypatch):
    monkeypatch.setattr(measure, "REPEATS", 1)  # what is checked is the table, not timing
    # the section's table at two strategies, one of them with tensor and sequence
    # parallelism (test_context proves each strategy's bytes on its own, compiled only)
    layouts = {
        k: long_sequences.CONTEXT[k]
        for k in ("S=256 context=8 ulysses", "S=256 context=4 tensor=2 sp")
    }
    monkeypatch.setattr(long_sequences, "CONTEXT", layouts)
    rows = run_bench(steps=2, only=["context"])["context"]
    assert list(rows) == list(layouts)
    for name, r in rows.items():
        context = r["report"].comm.by_axis["context"]
        assert context.wire == pytest.approx(context.minimum, rel=0.02), name
        assert r["tokens_per_s"] > 0
    assert "long sequences" in capsys.readouterr().out


@pytest.mark.slow
def test_experts_section_splits_the_experts_at_the_textbook_bytes(devices, capsys, monkeypatch):
    monkeypatch.setattr(measure, "REPEATS", 1)  # what is checked is the table, not timing
    cases = ("expert=1", "expert=4", "expert=2, dropless")
    monkeypatch.setattr(experts, "EXPERTS", {k: experts.EXPERTS[k] for k in cases})
    rows = run_bench(steps=2, only=["experts"])["experts"]
    one, four, dropless = (rows[k]["report"] for k in cases)
    assert one.comm.by_axis["expert"].wire == 0
    for report in (four, dropless):
        expert = report.comm.by_axis["expert"]
        assert expert.minimum > 0 and expert.wire == pytest.approx(expert.minimum, rel=0.02)
    assert rows["expert=2, dropless"]["dropped"] == 0 < rows["expert=4"]["dropped"]
    # the experts' weights are most of the model: split over 4, the device holds far less
    assert four.memory_per_device.params < 0.5 * one.memory_per_device.params
    assert "mixture of experts" in capsys.readouterr().out


def test_unknown_section_exits_2():
    done = jaxpar_command("bench", "--only", "strategies", "warp")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "jaxpar: error: jaxpar bench --only warp: no such section; "
        "choose from strategies schedules dp hosts offload remat context experts checkpoint "
        "longest "
        "compile plan generate grpo optimizers speculative"
    )


@pytest.mark.slow
def test_hosts_section_puts_replicas_and_averaging_beside_flat_zero(devices, capsys, monkeypatch):
    monkeypatch.setattr(measure, "REPEATS", 1)  # what is checked is bytes, not timing
    checked = ("flat zero1", "replica2 zero1", "params every 1", "params every 36")
    monkeypatch.setattr(hosts, "ACROSS_HOSTS", {k: hosts.ACROSS_HOSTS[k] for k in checked})
    rows = run_bench(steps=2, only=["hosts"])["hosts"]
    flat, hsdp = rows["flat zero1"]["report"].comm, rows["replica2 zero1"]["report"].comm
    # across the two halves: the replicas' slice only, against the flat ring's two hops
    assert rows["replica2 zero1"]["across_2_hosts"] == pytest.approx(
        hsdp.by_axis["replica"].minimum, rel=0.01
    )
    assert rows["flat zero1"]["across_2_hosts"] == pytest.approx(
        flat.by_axis["data"].wire * 2 / 8, rel=0.01
    )
    every = {k: rows[f"params every {k}"]["report"].comm.by_axis["data"].wire for k in (1, 36)}
    assert every[1] / every[36] == pytest.approx(36, rel=0.02)
    assert "across 2 hosts" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_takes_a_config_and_skips_what_it_cannot_split(
    devices, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)  # where the picture goes by default
    two = {name: strategies.STRATEGIES[name] for name in ("dp8-zero0", "tp8")}
    monkeypatch.setattr(strategies, "STRATEGIES", two)
    base = Base("gpt-tiny", ("model.heads=2", "model.embed=32"))
    rows = run_bench(base, steps=1, only=["strategies"])["strategies"]
    assert rows["dp8-zero0"]["report"].config["model"]["embed"] == 32
    assert "model.heads=2 is not divisible by parallel.tensor=8" in rows["tp8"]["skipped"]
    out = capsys.readouterr().out
    assert "gpt-tiny model.heads=2 model.embed=32 on 8 cpu devices" in out
    assert "skipped tp8: model.heads=2" in out
    assert (tmp_path / "bench-strategies.png").is_file()


@pytest.mark.slow
def test_compile_time_does_not_grow_with_depth(devices, monkeypatch, capsys):
    """The layer stack is scanned: 32 layers are the same program as 4 (the compiler's
    work, counted in HLO lines; the seconds are the bench's to report, not to assert)."""
    layouts = {"dp8-zero3": by_depth.COMPILE_LAYOUTS["dp8-zero3"]}
    monkeypatch.setattr(by_depth, "COMPILE_LAYOUTS", layouts)
    monkeypatch.setattr(by_depth, "COMPILE_DEPTHS", (4, 32))
    depths = run_bench(only=["compile"])["compile"]["dp8-zero3"]
    assert depths[32]["hlo_lines"] == depths[4]["hlo_lines"]
    assert "32 / 4" in capsys.readouterr().out


@pytest.mark.slow
def test_the_strategies_picture_is_drawn(devices, tmp_path):
    from helpers import compile_only

    from jaxpar.training.metrics import plot_strategies

    results = {
        name: {"report": compile_only("gpt-tiny", overrides), "step_s": 0.02}
        for name, overrides in list(strategies.STRATEGIES.items())[:2]
    }
    plot_strategies(results, tmp_path / "bench.png", "two strategies")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_plan_section_times_the_70b_plan(capsys):
    """The planner's speed is a benchmark, not an assert (wall-clock differs by machine)."""
    row = run_bench(only=["plan"])["plan"]["gpt-70b"]
    assert row["considered"] > 1000 and 0 < row["fit"] < row["considered"]
    assert row["seconds"] > 0 and "layouts considered" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_section_reports_speeds_and_the_cache_against_its_formula(devices, monkeypatch):
    """The layouts' table, and the peer's (in its own process of one device): what is
    checked is the tables and the bytes a step must read, not timing."""
    monkeypatch.setattr(generate, "LAYOUT_NEW", 4)
    two = {k: v for k, v in generate.LAYOUTS.items() if k != "tensor=2"}
    monkeypatch.setattr(generate, "LAYOUTS", two)
    cases = (generate.Case(2, 4, sampled=True),)
    monkeypatch.setattr(generate, "PEER_CASES", cases)
    monkeypatch.setattr(generate, "COMMAND_CASE", generate.Case(2, 4))
    monkeypatch.setattr(generate, "ROUNDS", 1)
    results = run_bench(only=["generate"])
    rows = results["generate"]
    assert set(rows) == set(two)
    # llama-tiny: 2 (k, v) x 4 layers x 2 kv heads x 8 dims x 4 bytes; deepseek-tiny's
    # latent cache: 4 layers x (8 rotated key + 32 latent dims) x 4 bytes; gemma3-tiny's,
    # 2 x 2 kv heads x 32 dims x 4 bytes a layer's slot, over the 80 slots (a bucket of
    # 64 prompt ids and 16 new) 2 global layers hold every slot, 5 local ones 16
    want = {name: 2 * 4 * 2 * 8 * 4 for name in two} | {
        "deepseek-tiny, one device": 4 * 40 * 4,
        "gemma3-tiny, one device": 2 * 2 * 32 * 4 * (2 * 80 + 5 * 16) / 80,
    }
    for name, r in rows.items():
        assert r["cache_bytes_per_token"] == r["formula_bytes_per_token"] == want[name]
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
    peer = results["generate-peer"]
    assert list(peer) == ["2 x 4 sampled", "2 x 4, the command"]
    # the command as a user runs it: `jaxpar generate` in a fresh process, every token
    command = peer.pop("2 x 4, the command")
    assert command["prefill_tokens_per_s"] > 0 and command["call_tokens_per_s"] > 0
    # the weights (8 layers of 512 x (512 + 2 x 256 + 512 + 3 x 1536) and 2 x 2048 x 512
    # for the embedding and head; 2 norms a layer and the last, 512 each) in fp32 and the
    # cache of each row filled to 16 + 4 / 2 ids, 2 x 8 x 4 x 64 x 4 bytes each
    weights = 4 * (8 * (512 * (512 + 2 * 256 + 512 + 3 * 1536) + 2 * 512) + 2 * 2048 * 512 + 512)
    for case, r in zip(cases, peer.values(), strict=True):
        assert r["step_bytes"] == weights + case.prompts * 18 * 2 * 8 * 4 * 64 * 4
        assert r["peer_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["over_roofline"] == pytest.approx(
            r["step_ms"] / 1e3 / (r["step_bytes"] / (r["copy_gb_per_s"] * 1e9))
        )
