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

Gate: speculators 0.9.0 (the two methods were read from it); elsewhere a warning and no change. Without a process
group (one rank) the wrappers return speculators' own answer untouched.
"""

from __future__ import annotations

import logging

from .gate import speculators_supported

SUPPORTED_SPECULATORS = ("0.9.0",)
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
