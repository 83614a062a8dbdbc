"""Every rank resumes from the checkpoint global rank 0 chose: two wrappers (speculators 0.9.0; nodes sharing --output).

speculators picks the checkpoint to resume from on every rank by itself: `BaseCheckpointer._get_previous_epoch`
lists --output (the highest numbered folder) and `Trainer._load_training_state` reads that folder's
`training_state.json` (the step inside the epoch). On one node every rank sees the same folder. Nodes sharing it
over NFS see it through their own client's caches (directory entries and attributes kept up to `acdirmax`, 60 s by
default): node 1 can list --output as it was before node 0 tidied it a moment ago (an incomplete checkpoint deleted,
`interrupted/` moved into place as `<epoch>/`: resume.py). Its ranks would then resume another epoch or step than
rank 0: DDP still broadcasts rank 0's weights, but their optimizer and lr state come from another folder, and ranks
counting other epochs or steps wait in a collective the others never enter (a hang until the NCCL timeout).

So every rank takes global rank 0's choice, sent over the process group right where speculators makes it: the
epoch (a rank that listed another one says so in one warning naming both) and the training state read by rank 0.
Rank 0 runs on node 0, the node that tidied --output (nodes.py), so its view is the one that counts. A rank that
then cannot open the chosen folder's files fails loudly in speculators' load (torchrun.py names the rank).

Before that first collective, every rank shows the others the run it was started for (stage 04's identity, which
04 sets in IDENTITY_ENV for the ranks it starts): nodes started with other flags stop there, every rank with one
line naming the first setting that differs. Node 0 refuses a node whose flags differ from its finished or started
run's manifest, but a node started first finds no manifest yet: its ranks would train, say, another lr than the
manifest records, and exit 0.

Gate: speculators 0.9.0 (the two methods were read from it); elsewhere a warning and no change. Without a process
group (one rank) the wrappers return speculators' own answer untouched.
"""

from __future__ import annotations

import json
import logging
import os
import socket

from ..errors import ConfigError
from ..ranks import write_exit
from ..stage import first_difference
from .gate import speculators_supported

SUPPORTED_SPECULATORS = ("0.9.0",)
IDENTITY_ENV = "EAGLE3_RUN_IDENTITY"  # the run's identity (JSON), set by stage 04 for every rank it starts
_applied = False

log = logging.getLogger("eagle3")


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank0_choice(own):
    """Global rank 0's value of `own` on every rank (a picklable value; `own` itself without a process group)."""
    if _group_size() == 1:
        return own
    import torch.distributed as dist

    box = [own]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def require_one_run(save_path) -> None:
    """Every rank was started for global rank 0's run (IDENTITY_ENV); else every rank raises the same one line.
    Past the gather every rank is in the process group: each says so in its rank record (`joined`), which ends
    the launcher's watch for nodes gone before the rendezvous (nodes.run_launch)."""
    if _group_size() == 1:
        return
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (os.environ.get(IDENTITY_ENV), socket.gethostname()))
    write_exit(save_path, "running", joined=True)
    reference, first_host = gathered[0]
    for rank, (identity, host) in enumerate(gathered):
        if identity != reference:
            field, there, here = first_difference(json.loads(reference or "{}"), json.loads(identity or "{}")) or (
                "identity", reference, identity)
            raise ConfigError(f"rank {rank} on {host} was started for another run than rank 0 on {first_host}: "
                              f"{field} = {json.dumps(there)} there, {json.dumps(here)} on rank {rank}; start every "
                              f"node with the same command")


def apply() -> bool:
    """Wrap the two methods (once per process); True when installed."""
    global _applied

    if _applied:
        return True
    if not speculators_supported(SUPPORTED_SPECULATORS):
        log.warning("compat/resume_agreement.py: speculators is not %s; ranks on several nodes each pick the checkpoint "
                    "to resume from by their own listing of --output", SUPPORTED_SPECULATORS)
        return False
    from speculators.train import checkpointer, trainer

    list_previous_epoch = checkpointer.BaseCheckpointer._get_previous_epoch
    read_training_state = trainer.Trainer._load_training_state

    def _get_previous_epoch(self) -> int:
        require_one_run(self.path)  # speculators' first collective point, in its checkpointer's set-up on every rank
        own = list_previous_epoch(self)
        chosen = rank0_choice(own)
        if chosen != own:
            import torch.distributed as dist

            log.warning("rank %d lists checkpoint %s in %s where rank 0 lists %s (this node's view of the shared "
                        "folder is older: its filesystem caches directory entries); resuming from rank 0's",
                        dist.get_rank(), own if own != -1 else "none", self.path, chosen if chosen != -1 else "none")
        return chosen

    def _load_training_state(self) -> dict:
        import torch.distributed as dist

        own = read_training_state(self) if _group_size() == 1 or dist.get_rank() == 0 else None
        return rank0_choice(own)

    _get_previous_epoch._eagle3_resume_agreement = True  # what tests/test_compat.py looks for
    checkpointer.BaseCheckpointer._get_previous_epoch = _get_previous_epoch
    trainer.Trainer._load_training_state = _load_training_state
    _applied = True
    return True
