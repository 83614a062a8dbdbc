"""Stage 06's verdict: a draft whose acceptance in vLLM is ~1 fails loudly, naming the causes it can check.

Every kind speculators 0.9.0 trains that vLLM serves (eagle3, peagle, dflash, dflash2, dspark: draft_kinds.py) is
judged alike: tau and acceptance per position 1..k (a block is verified left to right like a chain), which of those
positions the draft was trained for (draft_kinds.verdict_positions), and the as-trained checks below, each reading
the keys the draft's kind keeps (its layer ids: `eagle_aux_hidden_state_layer_ids` for eagle3/peagle,
`aux_hidden_state_layer_ids` for the DFlash family).

"Training converged, acceptance ~1" is the most common report against EAGLE-3 trainers. Its causes, and
which of them can be checked from the files alone (`self_checks`, run before any engine starts):
- aux layer ids: the draft's `eagle_aux_hidden_state_layer_ids` outside the target's layers, or not the
  ids stage 04 trained on (vLLM feeds the draft the layers its config names);
- d2t: missing from the draft's weights, or not stage 03's mapping (draft token i means target token
  i + d2t[i]: a lost or regenerated mapping makes every draft token wrong);
- method: a config vLLM would not serve as `eagle3` (`eagle` instead of `eagle3` gives tau exactly 1);
- template: prompts rendered with other chat-template kwargs (thinking on/off) or another tokenizer than
  stage 01 trained on;
- weights: the draft's tensors against its config and the target (hidden size, vocab sizes, the decoder layers its
  config's num_hidden_layers names, the fc input of one hidden state per aux layer, the norms before fc its config
  names: fc_norm / norm_before_fc): weights
  from another target, or a config edited apart from them;
and what cannot: hidden states that were zero, shifted or missing a layer at extraction (stage 02's
checks and `02 --validate` guard those), or too little training. The verdict line names the failed
checks first, else says the checkable causes are ruled out and names the rest.

A finding that `blocks` (the method, layer ids outside the target, weights that do not fit) means vLLM cannot
serve the draft at all (it would stop with a traceback, or measure nothing): stage 06 stops on it before any
engine starts. The others are measured and named in the verdict; a draft not served as trained (a d2t other than
stage 03's, layer ids other than stage 04's: `AS_TRAINED`) fails it whatever its tau (on the H200 a draft served
one layer deeper kept 98% of its tau: above every floor, yet a wrong draft), while a template other than trained
is a serving mode the user chose to measure and only named. `read_draft` reads the draft's two files (a draft in SGLang's layout
as its speculators-format twin, sglang_layout.speculators_view); a file missing, cut short or unreadable is one line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import draft_kinds, sglang_layout
from .errors import ContractError, DraftRejected
from .files import safetensors_problem

log = logging.getLogger("eagle3")

# Local imports: safetensors: where the draft's weights are read.

DRAFT_CONFIG, DRAFT_WEIGHTS = "config.json", "model.safetensors"  # what vLLM loads (export.DRAFT_FILES)
OK, PROBLEM, UNCHECKED = "ok", "problem", "unchecked"
AS_TRAINED = ("layer ids", "d2t")  # checks whose problem means the files are not the draft stage 04 trained
UNCHECKABLE_CAUSES = ("the hidden states it was trained on (zero, shifted or missing a layer: "
                      "02_extract_hidden_states.py --validate)", "too little training (04's summary.txt)")


@dataclass(frozen=True)
class Finding:
    check: str  # "layer ids", "d2t", "method", "template"
    status: str  # OK, PROBLEM or UNCHECKED
    detail: str
    blocks: bool = False  # a PROBLEM vLLM cannot serve at all: stage 06 stops before any engine
    file: str = DRAFT_CONFIG  # the draft's file the finding is about (named in the refusal)

    def as_dict(self) -> dict:
        return asdict(self)


def check_layer_ids(draft_config: dict, target_layers: int, trained_ids: list[int] | None, kind=None) -> Finding:
    """The aux layer ids under the key the draft's kind (a draft_kinds.DraftKind; None: eagle3) keeps them."""
    kind = kind or draft_kinds.kind(None)
    ids = draft_kinds.draft_layer_ids(kind, draft_config)
    if not ids:
        return Finding("layer ids", PROBLEM, f"draft config.json has no {kind.layer_ids_key} "
                                             f"(vLLM would feed its own default layers)")
    outside = [i for i in ids if not 0 < i < target_layers]
    if outside:
        return Finding("layer ids", PROBLEM, f"aux layer ids {ids}: {outside} not inside the target's "
                                             f"{target_layers} layers (1..{target_layers - 1})", blocks=True)
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


def check_method(draft_config: dict, method: str, kind=None, kind_method: str | None = None) -> Finding:
    """The draft's config is the kind (a draft_kinds.DraftKind; None: eagle3) served with `method`, the one vLLM
    serves that kind with (`kind_method`; None: the kind's name), and holds the mask token a kind that needs one
    is served with (vLLM reads config.json's mask_token_id)."""
    kind = kind or draft_kinds.kind(None)
    kind_method = kind_method or kind.name
    model_type = draft_config.get("speculators_model_type")
    if model_type != kind.name or method != kind_method:
        needs = ("an EAGLE-3 draft needs both 'eagle3'" if kind.name == "eagle3" == kind_method else
                 f"a {kind.name} draft needs speculators_model_type {kind.name!r} served as {kind_method!r}")
        return Finding("method", PROBLEM, f"draft config speculators_model_type {model_type!r}, served with method "
                                          f"{method!r}; {needs}", blocks=True)
    if kind.needs_mask_token and draft_config.get("mask_token_id") is None:
        return Finding("method", PROBLEM, f"draft config.json has no mask_token_id, which vLLM serves a {kind.name} "
                                          f"draft with (its placeholder token)", blocks=True)
    if kind.name == "eagle3":
        return Finding("method", OK, "eagle3 (config and serving)")
    return Finding("method", OK, f"{kind.name} served as {method} (config and serving)")


def check_weights(draft_config: dict, shapes: dict[str, list[int]], target_hidden_size: int,
                  target_vocab_size: int, kind=None) -> Finding:
    """The draft's tensors (name -> shape, from its safetensors header) against its config and the target, as
    vLLM's loader will need them: a draft trained for another target, or weights copied from one. Every kind
    speculators trains keeps these tensors (fc over the aux states, the decoder layers, norm, lm_head, d2t/t2d);
    `kind` (None: eagle3) says where its config keeps the aux layer ids."""
    layer = draft_config.get("transformer_layer_config") or {}
    hidden, vocab = layer.get("hidden_size"), layer.get("vocab_size")
    draft_vocab = draft_config.get("draft_vocab_size") or vocab
    fed = draft_config.get("target_hidden_size") or hidden  # the width of the target's hidden states it reads
    aux = len(draft_kinds.draft_layer_ids(kind or draft_kinds.kind(None), draft_config) or []) or 3
    problems = []
    if vocab != target_vocab_size:
        problems.append(f"config.json vocab_size {vocab}, the target's {target_vocab_size}")
    if fed != target_hidden_size:
        problems.append(f"config.json takes hidden states of width {fed}, the target's are {target_hidden_size}")
    expected = {"fc.weight": [hidden, aux * (fed or 0)], "lm_head.weight": [draft_vocab, hidden], "norm.weight": [hidden],
                "embed_tokens.weight": [vocab, hidden], "d2t": [draft_vocab], "t2d": [vocab]}
    required = ("fc.weight", "lm_head.weight", "norm.weight")
    problems += [f"no {name}" for name in required if name not in shapes]
    layers = sorted({int(name.split(".")[1]) for name in shapes if name.startswith("layers.")
                     and name.split(".")[1].isdigit()})
    if not layers:
        problems.append("no decoder layer (layers.*)")
    configured = layer.get("num_hidden_layers")
    if layers and configured is not None and layers != list(range(configured)):
        held = f"{len(layers)} decoder layer{'s' if len(layers) != 1 else ''} (layers.{', layers.'.join(map(str, layers))})"
        problems.append(f"config.json says num_hidden_layers {configured}, the weights hold {held}")
    problems += [f"{name} {list(shapes[name])}, its config and the target say {want}"
                 for name, want in expected.items() if name in shapes and list(shapes[name]) != want]
    norm_problems = fc_input_norm_problems(draft_config, shapes, aux, fed)
    if problems or norm_problems:
        shown = problems + norm_problems
        shown = "; ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
        other = [p for p in problems if not p.startswith("config.json says num_hidden_layers")]
        cause = "weights of a draft for another target?" if other else "a config edited apart from its weights?"
        return Finding("weights", PROBLEM, f"the draft's weights do not fit its config and the target: {shown} "
                                           f"({cause})", blocks=True, file=DRAFT_WEIGHTS)
    return Finding("weights", OK, f"{len(shapes)} tensors fit the config and the target (hidden {hidden}, "
                                  f"vocab {vocab}, draft vocab {draft_vocab})", file=DRAFT_WEIGHTS)


def fc_input_norm_problems(draft_config: dict, shapes: dict[str, list[int]], aux: int, fed: int | None) -> list[str]:
    """The norms before the fc projection as the config says and as the weights hold them. vLLM builds them from
    the config alone: a config with fc_norm (or norm_before_fc) whose weights lack them serves norms of weight 1,
    never trained; weights with fc_norm.* under a config without fc_norm stop vLLM's loader with a traceback;
    input_norm.weight under a config without norm_before_fc is dropped silently (served without the norm it
    trained with)."""
    problems = []
    fc_norm_names = sorted(name for name in shapes if name.startswith("fc_norm."))
    wanted = [f"fc_norm.{i}.weight" for i in range(aux)]
    if draft_config.get("fc_norm"):
        missing = [name for name in wanted if name not in shapes]
        if missing:
            problems.append(f"config.json says fc_norm but the weights have no {', '.join(missing)}")
        problems += [f"{name} {list(shapes[name])}, its config and the target say {[fed]}"
                     for name in wanted if name in shapes and list(shapes[name]) != [fed]]
        if extra := sorted(set(fc_norm_names) - set(wanted)):
            problems.append(f"{', '.join(extra)} beyond the config's {aux} aux layers")
    elif fc_norm_names:
        problems.append(f"the weights hold {', '.join(fc_norm_names)} but config.json has no fc_norm")
    if draft_config.get("norm_before_fc"):
        if "input_norm.weight" not in shapes:
            problems.append("config.json says norm_before_fc but the weights have no input_norm.weight")
        elif list(shapes["input_norm.weight"]) != [aux * (fed or 0)]:
            problems.append(f"input_norm.weight {list(shapes['input_norm.weight'])}, its config and the target say "
                            f"{[aux * (fed or 0)]}")
    elif "input_norm.weight" in shapes:
        problems.append("the weights hold input_norm.weight but config.json has no norm_before_fc")
    return problems


def read_draft(draft_dir: Path) -> tuple[dict, dict[str, list[int]], np.ndarray | None]:
    """An exported draft's config, its tensors' shapes and its d2t (None: none); a file missing, cut short or
    unreadable (a half-written export) is one line naming it, before anything else reads it."""
    draft_dir = Path(draft_dir)
    redo = "a half-written or damaged export: export it again (05_export.py)"
    for name in (DRAFT_CONFIG, DRAFT_WEIGHTS):
        if not (draft_dir / name).is_file():
            raise ContractError(f"{draft_dir / name}: missing; {redo}")
    config_path, weights_path = draft_dir / DRAFT_CONFIG, draft_dir / DRAFT_WEIGHTS
    try:
        config = json.loads(config_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractError(f"{config_path}: unreadable JSON ({exc}); {redo}") from None
    if not isinstance(config, dict):
        raise ContractError(f"{config_path}: not a JSON object; {redo}")
    problem = safetensors_problem(weights_path)
    if problem:
        raise ContractError(f"{weights_path}: {problem}; {redo}")
    from safetensors import safe_open

    try:
        with safe_open(str(weights_path), framework="np") as weights:
            shapes = {name: list(weights.get_slice(name).get_shape()) for name in weights.keys()}
            d2t = weights.get_tensor("d2t") if "d2t" in shapes else None
    except Exception as exc:  # safetensors raises its own types (a dtype it does not know, a bad offset)
        raise ContractError(f"{weights_path}: unreadable safetensors ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); {redo}") from None
    if sglang_layout.is_sglang(config):  # 05 --layout sglang: checked as its speculators-format twin
        config, shapes = sglang_layout.speculators_view(config, shapes)
    return config, shapes, d2t


def check_template(used_kwargs: dict, trained_kwargs: dict, tokenizer_sha256: str | None,
                   trained_tokenizer_sha256: str | None) -> Finding:
    if used_kwargs != trained_kwargs:
        return Finding("template", PROBLEM, f"prompts rendered with chat_template_kwargs {used_kwargs}, stage 01 "
                                            f"trained with {trained_kwargs} (thinking mode changes what the draft sees)")
    if tokenizer_sha256 != trained_tokenizer_sha256:
        return Finding("template", PROBLEM, "the target's tokenizer / chat template files changed since stage 01 "
                                            "rendered the training rows")
    return Finding("template", OK, f"stage 01's chat template and kwargs {trained_kwargs}")


def positions_line(positions: dict | None) -> str:
    """The positions a draft served at k was not trained for, as the verdict line's tail ("" when none)."""
    untrained = (positions or {}).get("untrained") or []
    if not untrained:
        return ""
    span = f"{untrained[0]}..{untrained[-1]}" if len(untrained) > 1 else str(untrained[0])
    return f"; positions {span} of {len(positions['positions'])} never trained"


def verdict(spec: dict, findings: list[Finding], min_tau: float, min_first_acceptance: float,
            positions: dict | None = None) -> dict:
    """{"passed", "line", "findings"} from a `evaluate.summarize_spec_decode` summary and the self-checks.
    `positions`: draft_kinds.verdict_positions for the served k (recorded as "positions"; untrained ones named)."""
    judged = _verdict(spec, findings, min_tau, min_first_acceptance)
    if positions is not None:
        judged["line"] += positions_line(positions)
        judged["positions"] = positions
    return judged


def _verdict(spec: dict, findings: list[Finding], min_tau: float, min_first_acceptance: float) -> dict:
    tau, stderr = spec["mean_acceptance_length"], spec["mean_acceptance_length_stderr"]
    rates = spec["acceptance_rate_per_pos"]
    first = rates[0] if rates else 0.0
    measured = f"tau {tau:.3f} ± {stderr:.3f}, position-1 acceptance {first:.1%}"
    low = [f"tau <= {min_tau}"] if tau <= min_tau else []
    low += [f"position-1 acceptance < {min_first_acceptance:.0%}"] if first < min_first_acceptance else []
    problems = [f for f in findings if f.status == PROBLEM]
    wrong = [f for f in problems if f.check in AS_TRAINED]
    if not low and wrong:
        causes = "; ".join(f"{f.check}: {f.detail}" for f in wrong)
        return {"passed": False, "line": f"verdict: FAIL: {measured}, but the draft is not served as trained: {causes}",
                "findings": [f.as_dict() for f in findings]}
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


def self_checks(draft: tuple[dict, dict, np.ndarray | None], plan, target, trained, vocab, prepared,
                template_kwargs: dict, trained_kwargs: dict) -> list[Finding]:
    """Stage 06's checks of the files, before any engine starts: `draft` is read_draft's (config, shapes, d2t),
    `plan` export.evaluation_plan's (the kind, the method it is served with); the manifests are 04's, 03's, 01's.
    Each finding is logged (a problem as a warning)."""
    from .vocab import D2T_NAME

    config, shapes, d2t = draft
    vocab_file = Path(vocab.directory) / D2T_NAME
    findings = [
        check_layer_ids(config, target.num_layers, trained.aux_layer_ids, plan.kind),
        check_d2t(d2t, np.load(vocab_file) if vocab_file.is_file() else None, str(vocab_file)),
        check_method(config, plan.speculative_config["method"], plan.kind, plan.kind_method),
        check_template(template_kwargs, trained_kwargs, target.tokenizer_sha256, prepared.target["tokenizer_sha256"]),
        check_weights(config, shapes, target.hidden_size, target.vocab_size, plan.kind),
    ]
    for finding in findings:
        (log.warning if finding.status == PROBLEM else log.info)("self-check %s: %s: %s", finding.check,
                                                                  finding.status, finding.detail)
    return findings


def check_line(findings: list[Finding], num_prompts: int, measurement: str) -> str:
    """06 --check's summary line."""
    checks = "; ".join(f"{f.check} {f.status}" for f in findings)
    return f"06 --check: ran the self-checks ({checks}) and rendered {num_prompts} prompts; tau in vLLM {measurement}"


def refuse_blocking(findings: list[Finding], draft_dir: Path, check: bool, num_prompts: int) -> None:
    """A draft vLLM cannot serve (another method, layer ids outside the target, weights that do not fit) stops
    before any engine: it would end in a traceback, or measure nothing worth a verdict. Another method is the
    verdict's own cause (tau exactly 1 in vLLM): the verdict's exit code, 6."""
    blocking = [f for f in findings if f.blocks and f.status == PROBLEM]
    if not blocking:
        return
    if check:
        print(check_line(findings, num_prompts, "not measured: vLLM cannot serve this draft"))
    first = blocking[0]
    error = DraftRejected if first.check == "method" else ContractError
    raise error(f"{Path(draft_dir) / first.file}: vLLM cannot serve this draft ({first.check}: {first.detail}); "
                f"no engine was started: export the draft for this target again (05_export.py)")
