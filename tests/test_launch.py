"""Multi-GPU / multi-node launch lines and the split of extraction across replicas, on the CPU.

The torchrun lines are parsed back with torch's own `torch.distributed.run` parser and turned
into its LaunchConfig, so a flag torchrun does not know, or a rendezvous it would resolve
differently, fails here rather than on the cluster. DeepSpeed is not installed here: its line
is checked against the runner's documented argument layout (launcher flags, then the module,
then the script's flags untouched).
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.config import ExtractConfig, TrainConfig
from eagle3_pipeline.errors import ConfigError, InputError
from eagle3_pipeline.extract.common import partition_indices
from eagle3_pipeline.extract.run import all_rows_landed, plan_extraction
from eagle3_pipeline.hidden_states import hs_file
from eagle3_pipeline.training import launch_command

SPEC_ARGV = ["--verifier-name-or-path", "/models/K", "--save-path", "/shared/ckpt", "--total-seq-len", "32768",
             "--target-layer-ids", "2", "30", "58"]
ENTRY = ["-m", "eagle3_pipeline.train_entry", *SPEC_ARGV]


def train_cfg(**overrides) -> TrainConfig:
    return TrainConfig(target="t", data="d", vocab="v", output="o", **overrides)


def torchrun_config(cmd: list[str]):
    """torchrun's own view of our command line: (LaunchConfig, module/script, its args)."""
    from torch.distributed.run import config_from_args, get_args_parser

    assert cmd[:3] == [sys.executable, "-m", "eagle3_pipeline.torchrun"]  # torch.distributed.run, less its traceback
    args = get_args_parser().parse_args(cmd[3:])
    return args, config_from_args(args)


def test_one_process_runs_in_process_without_a_launcher():
    assert launch_command(train_cfg(), SPEC_ARGV) is None


def test_torchrun_single_node_is_standalone_with_one_process_per_gpu():
    cmd = launch_command(train_cfg(nproc=8), SPEC_ARGV)
    assert cmd[-len(ENTRY):] == ENTRY  # speculators' flags pass through untouched
    args, (config, script, script_args) = torchrun_config(cmd)
    assert args.standalone and args.module
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, 8)
    assert (script, script_args) == (sys.executable, ["-u", *ENTRY])  # each worker: python -u -m entry FLAGS


@pytest.mark.parametrize("node_rank", [0, 1])
def test_torchrun_multi_node_uses_static_rendezvous_at_node_0(node_rank):
    cfg = train_cfg(nproc=8, nnodes=2, node_rank=node_rank, rdzv_endpoint="10.0.0.1:29500")
    cmd = launch_command(cfg, SPEC_ARGV)
    args, (config, script, script_args) = torchrun_config(cmd)
    assert not args.standalone
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 8)
    assert config.rdzv_backend == "static"  # node ranks as given: global rank 0 lives on node 0
    assert config.rdzv_endpoint == "10.0.0.1:29500"
    assert config.rdzv_configs["rank"] == node_rank
    assert script_args == ["-u", *ENTRY]


def test_multi_node_lines_differ_only_in_the_node_rank():
    lines = [launch_command(train_cfg(nproc=8, nnodes=4, node_rank=r, rdzv_endpoint="head:29500"), SPEC_ARGV)
             for r in range(4)]
    for rank, line in enumerate(lines):
        assert line[line.index("--node-rank") + 1] == str(rank)
        assert [a for i, a in enumerate(line) if i != line.index("--node-rank") + 1] == \
               [a for i, a in enumerate(lines[0]) if i != lines[0].index("--node-rank") + 1]


@pytest.mark.parametrize("overrides, message", [
    ({"nnodes": 2}, "--rdzv-endpoint"),
    ({"nnodes": 2, "rdzv_endpoint": "head"}, "HOST:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": "head:port"}, "HOST:PORT"),
    ({"nnodes": 2, "launcher": "deepspeed"}, "--hostfile"),
])
def test_bad_multi_node_settings_are_refused_naming_the_flag(overrides, message):
    with pytest.raises(ConfigError, match=message):
        launch_command(train_cfg(nproc=8, **overrides), SPEC_ARGV)


def test_a_node_rank_outside_the_nodes_is_refused_by_the_config_itself():
    """Before the launch (issue 64): a multi-node 04 writes its node record into the shared --output first."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"must be in \[0, --nnodes 2\)"):
        train_cfg(nproc=8, nnodes=2, node_rank=2, rdzv_endpoint="head:29500")


def test_ipv6_endpoint_is_split_at_the_last_colon():
    cmd = launch_command(train_cfg(nproc=2, nnodes=2, rdzv_endpoint="[fd00::1]:29500"), SPEC_ARGV)
    assert cmd[cmd.index("--master-addr") + 1] == "fd00::1" and cmd[cmd.index("--master-port") + 1] == "29500"


def test_deepspeed_hostfile_launch_starts_the_same_trainer(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    cfg = train_cfg(nproc=8, nnodes=2, launcher="deepspeed", hostfile=str(hostfile), rdzv_endpoint="node-a:29500")
    cmd = launch_command(cfg, SPEC_ARGV)
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]  # the `deepspeed` script, this env
    launcher_flags = cmd[3:cmd.index("--module")]
    assert launcher_flags[:6] == ["--num_gpus", "8", "--hostfile", str(hostfile), "--num_nodes", "2"]
    assert "--master_addr" in launcher_flags and launcher_flags[launcher_flags.index("--master_port") + 1] == "29500"
    # speculators' parser refuses the --local_rank=N DeepSpeed appends by default (LOCAL_RANK is set anyway)
    assert "--no_local_rank" in launcher_flags
    assert cmd[cmd.index("--module"):] == ["--module", "eagle3_pipeline.train_entry", *SPEC_ARGV]


def test_deepspeed_single_node_needs_no_hostfile():
    cmd = launch_command(train_cfg(nproc=4, launcher="deepspeed"), SPEC_ARGV)
    assert "--hostfile" not in cmd and "--num_nodes" not in cmd
    assert cmd[3:5] == ["--num_gpus", "4"] and cmd[-len(SPEC_ARGV) - 1:] == ["eagle3_pipeline.train_entry", *SPEC_ARGV]


@pytest.mark.slow  # imports speculators' trainer config (seconds)
def test_speculators_parser_refuses_deepspeeds_local_rank_flag():
    """Why --no_local_rank: without it every rank would exit 2 at start-up."""
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig

    with pytest.raises(SystemExit) as stop:
        SpeculatorsTrainConfig.resolve(["--verifier-name-or-path", "x", "--data-path", "y", "--save-path", "z",
                                        "--local_rank=0"])
    assert stop.value.code == 2


# --- extraction split across replicas / nodes ---------------------------------------------

@pytest.mark.parametrize("rows", [0, 1, 7, 64, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_extraction_shares_are_disjoint_complete_and_balanced(rows, world_size):
    indices = list(range(rows))
    shares = [partition_indices(indices, world_size, rank) for rank in range(world_size)]
    flat = [i for share in shares for i in share]
    assert sorted(flat) == indices and len(flat) == len(set(flat))  # complete, disjoint
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
    assert all(share == list(range(share[0], share[-1] + 1)) for share in shares if share)  # contiguous


@pytest.mark.parametrize("rank, world_size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_world_is_refused(rank, world_size):
    with pytest.raises(InputError, match="--rank"):
        partition_indices(list(range(10)), world_size, rank)


def _land(hs_dir, index, ids, slots=4, hidden=8):
    # bf16: the directory's dtype (ExtractConfig's default); a file of another dtype is redone
    save_file({"hidden_states": torch.ones(len(ids), slots, hidden, dtype=torch.bfloat16), "token_ids": torch.tensor(ids)},
              str(hs_file(hs_dir, index)))


def test_ranks_fill_one_directory_and_the_job_is_done_only_when_every_rank_is(tmp_path):
    rows = [[i, i + 1, i + 2] for i in range(10)]
    plans = [plan_extraction(ExtractConfig(target="t", data="d", world_size=3, rank=r), rows, 4, 8, tmp_path)
             for r in range(3)]
    assert sorted(i for p in plans for i in p.todo) == list(range(10))
    assert all(p.all_indices == list(range(10)) for p in plans)  # every rank can tell when the job is done
    for i in plans[0].todo + plans[1].todo:
        _land(tmp_path, i, rows[i])
    assert not all_rows_landed(tmp_path, plans[2].all_indices)
    again = plan_extraction(ExtractConfig(target="t", data="d", world_size=3, rank=0), rows, 4, 8, tmp_path)
    assert again.todo == [] and again.counts["skipped_done"] == len(plans[0].todo)  # a rerun resumes
    for i in plans[2].todo:
        _land(tmp_path, i, rows[i])
    assert all_rows_landed(tmp_path, plans[0].all_indices)  # whichever rank finishes last writes the manifest
