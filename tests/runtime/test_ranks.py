"""Rank-consistent plans: with two gloo processes, a plan mismatch on one rank only makes every rank take the
same on_mismatch action (no rank left waiting in a collective), and load_plan(broadcast_from=0)."""

import datetime
import os
import socket
import time
import warnings

import pytest
import torch

import regen
from common import make, traced
from handmade import PLANS
from regen.errors import FormatError, PlanMismatchError
from regen.formats import save_plan

WORLD = 2
JOIN_TIMEOUT_S = 120  # a hang fails the test instead of stalling the suite
COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, *args):
    """Run `worker(rank, *args)` in WORLD processes; fail (and kill them) if they do not finish in time."""
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=(_free_port(),) + args, nprocs=WORLD, join=False)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks did not finish: one is waiting for the other")


def _init(rank, port):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _mismatch_worker(rank, port, plan_path, on_mismatch, result_path):
    """Rank 1 trains on a batch of another size than the plan's: its step does not match, rank 0's does."""
    import torch.distributed as dist

    _init(rank, port)
    try:
        plan = regen.load_plan(plan_path, broadcast_from=0)
        w = make("gpt", batch_size=2) if rank == 1 else make("gpt")  # DDP gives both rank 0's weights
        ddp = torch.nn.parallel.DistributedDataParallel(w.model)
        batch = w.batch
        out = {"error": None, "warnings": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = regen.apply(ddp, plan, on_mismatch=on_mismatch)
            try:
                for _ in range(2):  # the second step: both ranks are still in step with each other
                    loss = w.loss_fn(ddp(*batch), batch)
                    loss.backward()
            except PlanMismatchError as exc:
                out["error"] = str(exc)
            finally:
                handle.remove(abort=out["error"] is not None)
        out["warnings"] = [str(c.message) for c in caught if "regen.apply" in str(c.message)]
        out["planned_steps"] = handle.stats.planned_steps
        out["unplanned_steps"] = handle.stats.unplanned_steps
        out["dynamic_steps"] = handle.stats.dynamic_steps
        torch.save(out, f"{result_path}.{rank}")
    finally:
        # a DDP backward aborted by the mismatch can leave gloo threads that abort the interpreter's teardown
        # (SIGABRT, "terminate called without an active exception"); what the test reads is saved by now
        os._exit(0)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    _, trace = traced("gpt")
    path = tmp_path_factory.mktemp("ranks") / "gpt.plan.yaml"
    save_plan(PLANS["recompute"](trace), path)
    return str(path)


@pytest.mark.slow
def test_a_mismatch_on_one_rank_raises_on_every_rank(plan_path, tmp_path):
    result = str(tmp_path / "out")
    _spawn(_mismatch_worker, plan_path, "raise", result)
    out = [torch.load(f"{result}.{r}") for r in range(WORLD)]
    assert out[1]["error"] is not None and "another batch shape" in out[1]["error"]
    assert out[0]["error"] is not None and "another rank" in out[0]["error"]


@pytest.mark.slow
def test_a_mismatch_on_one_rank_keeps_going_on_every_rank(plan_path, tmp_path):
    result = str(tmp_path / "out")
    _spawn(_mismatch_worker, plan_path, "keep", result)
    out = [torch.load(f"{result}.{r}") for r in range(WORLD)]
    assert out[0]["error"] is None and out[1]["error"] is None
    assert out[1]["unplanned_steps"] == 2
    assert out[0]["unplanned_steps"] == 0 and out[0]["planned_steps"] == 2
    assert sum("another rank" in m for m in out[0]["warnings"]) == 2
    assert sum("running this step unplanned" in m for m in out[1]["warnings"]) == 2


def _load_worker(rank, port, good_path, broken_path, result_path):
    import torch.distributed as dist

    _init(rank, port)
    try:
        out = []
        for path in (good_path, broken_path):
            # only rank 0 can read the file: the others get the plan (or rank 0's error) from it
            try:
                plan = regen.load_plan(path if rank == 0 else "/nonexistent/plan.yaml", broadcast_from=0)
                out.append({"decisions": [d.action for d in plan.decisions], "error": None})
            except FormatError as exc:
                out.append({"decisions": None, "error": str(exc)})
        torch.save(out, f"{result_path}.{rank}")
        dist.barrier()  # both ranks leave together (test_robustness's DDP worker: a rank aborted at teardown)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_load_plan_on_rank_0_and_broadcast(plan_path, tmp_path):
    result = str(tmp_path / "out")
    broken = tmp_path / "broken.plan.yaml"
    broken.write_text("format: regen-plan/1\ndecisions: 3\n")
    _spawn(_load_worker, plan_path, str(broken), result)
    (good0, broken0), (good1, broken1) = [torch.load(f"{result}.{r}") for r in range(WORLD)]
    expected = [d.action for d in regen.load_plan(plan_path).decisions]
    assert good0["decisions"] == expected and good1["decisions"] == expected
    assert broken0["error"] is not None and "rank 0" not in broken0["error"]
    assert broken1["error"] is not None and "rank 0 could not read the plan" in broken1["error"]


@pytest.fixture(scope="module")
def plan_with_call_path(tmp_path_factory):
    """The recompute plan, recording the call it was made for (rank 0's batch)."""
    import dataclasses

    from regen.call_signature import call_signature
    from regen.workloads import call_arguments

    w, trace = traced("gpt")
    plan = dataclasses.replace(PLANS["recompute"](trace), call=call_signature(w.model, *call_arguments(w.batch)))
    path = tmp_path_factory.mktemp("ranks") / "gpt-call.plan.yaml"
    save_plan(plan, path)
    return str(path)


@pytest.mark.slow
def test_a_call_no_plan_fits_on_one_rank_runs_dynamic_on_every_rank(plan_with_call_path, tmp_path):
    result = str(tmp_path / "out")
    _spawn(_mismatch_worker, plan_with_call_path, "dynamic", result)
    out = [torch.load(f"{result}.{r}") for r in range(WORLD)]
    assert out[0]["error"] is None and out[1]["error"] is None
    assert [o["dynamic_steps"] for o in out] == [2, 2] and [o["planned_steps"] for o in out] == [0, 0]
