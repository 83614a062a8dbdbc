"""Stage 06's verdict: a draft whose acceptance in vLLM is ~1 fails loudly, naming the causes it can check.

"Training converged, acceptance ~1" is the most common report against EAGLE-3 trainers. Its causes, and
which of them can be checked from the files alone (`self_checks`, run before any engine starts):
- aux layer ids: the draft's `eagle_aux_hidden_state_layer_ids` outside the target's layers, or not the
  ids stage 04 trained on (vLLM feeds the draft the layers its config names);
- d2t: missing from the draft's weights, or not stage 03's mapping (draft token i means target token
  i + d2t[i]: a lost or regenerated mapping makes every draft token wrong);
- method: a config vLLM would not serve as `eagle3` (`eagle` instead of `eagle3` gives tau exactly 1);
- template: prompts rendered with other chat-template kwargs (thinking on/off) or another tokenizer than
  stage 01 trained on;
and what cannot: hidden states that were zero, shifted or missing a layer at extraction (stage 02's
checks and `02 --validate` guard those), or too little training. The verdict line names the failed
checks first, else says the checkable causes are ruled out and names the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

OK, PROBLEM, UNCHECKED = "ok", "problem", "unchecked"
UNCHECKABLE_CAUSES = ("the hidden states it was trained on (zero, shifted or missing a layer: "
                      "02_extract_hidden_states.py --validate)", "too little training (04's summary.txt)")


@dataclass(frozen=True)
class Finding:
    check: str  # "layer ids", "d2t", "method", "template"
    status: str  # OK, PROBLEM or UNCHECKED
    detail: str

    def as_dict(self) -> dict:
        return asdict(self)


def check_layer_ids(draft_config: dict, target_layers: int, trained_ids: list[int] | None) -> Finding:
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return Finding("layer ids", PROBLEM, "draft config.json has no eagle_aux_hidden_state_layer_ids "
                                             "(vLLM would feed its own default layers)")
    outside = [i for i in ids if not 0 < i < target_layers]
    if outside:
        return Finding("layer ids", PROBLEM, f"aux layer ids {ids}: {outside} not inside the target's "
                                             f"{target_layers} layers (1..{target_layers - 1})")
    if trained_ids is not None and list(ids) != list(trained_ids):
        return Finding("layer ids", PROBLEM, f"aux layer ids {ids} in the draft config, stage 04 trained on "
                                             f"{trained_ids}")
    return Finding("layer ids", OK, f"aux layer ids {ids} of a {target_layers}-layer target, as trained")


def check_d2t(draft_d2t: np.ndarray | None, vocab_d2t: np.ndarray | None, vocab_file: str) -> Finding:
    """`draft_d2t`: the draft's `d2t` weight (None: absent); `vocab_d2t`: stage 03's d2t.npy (None: not found)."""
    if vocab_d2t is None:
        return Finding("d2t", UNCHECKED, f"stage 03's {vocab_file} not found (pass --vocab)")
    if draft_d2t is None:
        if np.any(vocab_d2t != 0):
            return Finding("d2t", PROBLEM, f"the draft's model.safetensors has no d2t, stage 03's {vocab_file} "
                                           f"maps {len(vocab_d2t)} draft tokens (vLLM then reads draft ids as target ids)")
        return Finding("d2t", OK, "no d2t: the draft vocab is the target's (identity mapping)")
    if draft_d2t.shape != vocab_d2t.shape:
        return Finding("d2t", PROBLEM, f"the draft's d2t has shape {list(draft_d2t.shape)}, stage 03's {vocab_file} "
                                       f"{list(vocab_d2t.shape)}")
    differing = int(np.count_nonzero(draft_d2t != vocab_d2t))
    if differing:
        return Finding("d2t", PROBLEM, f"the draft's d2t differs from stage 03's {vocab_file} at {differing} of "
                                       f"{len(vocab_d2t)} entries (lost or regenerated mapping)")
    return Finding("d2t", OK, f"d2t equals stage 03's {vocab_file}")


def check_method(draft_config: dict, method: str) -> Finding:
    model_type = draft_config.get("speculators_model_type")
    if model_type != "eagle3" or method != "eagle3":
        return Finding("method", PROBLEM, f"draft config speculators_model_type {model_type!r}, served with method "
                                          f"{method!r}; an EAGLE-3 draft needs both 'eagle3'")
    return Finding("method", OK, "eagle3 (config and serving)")


def check_template(used_kwargs: dict, trained_kwargs: dict, tokenizer_sha256: str | None,
                   trained_tokenizer_sha256: str | None) -> Finding:
    if used_kwargs != trained_kwargs:
        return Finding("template", PROBLEM, f"prompts rendered with chat_template_kwargs {used_kwargs}, stage 01 "
                                            f"trained with {trained_kwargs} (thinking mode changes what the draft sees)")
    if tokenizer_sha256 != trained_tokenizer_sha256:
        return Finding("template", PROBLEM, "the target's tokenizer / chat template files changed since stage 01 "
                                            "rendered the training rows")
    return Finding("template", OK, f"stage 01's chat template and kwargs {trained_kwargs}")


def verdict(spec: dict, findings: list[Finding], min_tau: float, min_first_acceptance: float) -> dict:
    """{"passed", "line", "findings"} from a `evaluate.summarize_spec_decode` summary and the self-checks."""
    tau, stderr = spec["mean_acceptance_length"], spec["mean_acceptance_length_stderr"]
    rates = spec["acceptance_rate_per_pos"]
    first = rates[0] if rates else 0.0
    measured = f"tau {tau:.3f} ± {stderr:.3f}, position-1 acceptance {first:.1%}"
    low = [f"tau <= {min_tau}"] if tau <= min_tau else []
    low += [f"position-1 acceptance < {min_first_acceptance:.0%}"] if first < min_first_acceptance else []
    problems = [f for f in findings if f.status == PROBLEM]
    if not low:
        line = f"verdict: ok: {measured}"
        if problems:
            line += f" (but {'; '.join(f'{f.check}: {f.detail}' for f in problems)})"
        return {"passed": True, "line": line, "findings": [f.as_dict() for f in findings]}
    if problems:
        causes = "; ".join(f"{f.check}: {f.detail}" for f in problems)
        line = f"verdict: FAIL: {measured} ({', '.join(low)}); likely cause: {causes}"
    else:
        fine = ", ".join(f.check for f in findings if f.status == OK) or "nothing"
        unchecked = [f"{f.check} ({f.detail})" for f in findings if f.status == UNCHECKED]
        line = (f"verdict: FAIL: {measured} ({', '.join(low)}); checked and as trained: {fine}"
                + (f"; not checked: {', '.join(unchecked)}" if unchecked else "")
                + f"; so likely {' or '.join(UNCHECKABLE_CAUSES)}")
    return {"passed": False, "line": line, "findings": [f.as_dict() for f in findings]}
