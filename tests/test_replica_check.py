"""train.check_replicas_every: copies of parameters compared by hash; a corrupted copy
stops the run (exit 3) naming the leaf, the devices and the difference; healthy runs of
every strategy pass; the check costs a few bytes per leaf."""

import dataclasses

import pytest
from helpers import THREE_D_1F1B, perturb_one_copy, run

from jaxpar.errors import ReplicasDiverged
from jaxpar.training import trainer

CHECK = "train.check_replicas_every=1"
HEALTHY = {  # each ZeRO stage, replica, tensor with a pipeline, offload: where copies live
    "dp8-zero3": ("parallel.data=8", "parallel.zero=3"),
    "r2-dp4-zero2": ("parallel.replica=2", "parallel.data=4", "parallel.zero=2"),
    "3d-1f1b": tuple(THREE_D_1F1B),
    "offload": ("parallel.data=8", "parallel.zero=1", "parallel.offload=optimizer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", HEALTHY)
def test_silent_on_healthy_runs(devices, name):
    result = run("gpt-tiny", [*HEALTHY[name], CHECK], steps=3)
    cost = result.report.replica_check
    # ZeRO-3 over data=8 splits every gpt-tiny leaf: no copies to compare
    assert cost.every == 1 and (cost.leaves > 0) == (name != "dp8-zero3")
    # a few bytes per leaf (hashes and flags), never the parameters
    assert cost.wire_bytes_per_check < 64 * max(cost.leaves, 1)
    assert cost.share_of_step_comm < 0.01


def corrupting(monkeypatch, device_id: int, leaf: str, at: int = 2) -> None:
    """The trainer's compiled step, wrapped: after step `at`, one copy of `leaf` (on
    device `device_id`) is changed, as a faulty device would leave it."""
    real = trainer.prepare

    def prepare(*args, **kwargs):
        run = real(*args, **kwargs)
        compiled = run.step.executable

        def step(state, batch):
            state, step_metrics = compiled(state, batch)
            if int(state.step) != at:
                return state, step_metrics
            params = dict(state.params)
            params[leaf] = perturb_one_copy(params[leaf], device_id)
            return state.replace(params=params), step_metrics

        return dataclasses.replace(run, step=dataclasses.replace(run.step, executable=step))

    monkeypatch.setattr(trainer, "prepare", prepare)


@pytest.mark.slow
def test_a_corrupted_replica_stops_the_run_naming_it(devices, monkeypatch, tmp_path):
    corrupting(monkeypatch, 5, "head")
    with pytest.raises(ReplicasDiverged) as e:
        run("gpt-tiny", ["parallel.replica=2", "parallel.data=4", "parallel.zero=0", CHECK])
    message = str(e.value)
    assert message.startswith("step 2: copies of parameters that must be identical differ")
    assert "params/head (device 5 differs from the other copies over replica x data" in message
    assert "max difference 0.001" in message


@pytest.mark.slow
def test_a_tensor_copy_is_checked_and_the_state_saved(devices, monkeypatch, tmp_path):
    """ln_f/scale is whole on both tensor devices of a data shard; ZeRO-1 does not store
    it split. Device 3 is corrupted; the run saves that state and stops with exit 3."""
    from jaxpar.cli import main as cli

    corrupting(monkeypatch, 3, "ln_f/scale", at=3)
    argv = ["train", "--config", "gpt-tiny", "--cpu-devices", "8", "--out", str(tmp_path)]
    code = cli.main([*argv, "parallel.data=4", "parallel.tensor=2", "parallel.zero=1", CHECK])
    assert code == 3
    assert (tmp_path / "checkpoints" / "3").is_dir()
