"""Online and hybrid training: stage 04 against a running vLLM instead of stage 02's files.

speculators 0.9.0's contract, read from its code (train/data.py `ArrowDataset`, data_generation/
vllm_client.py `generate_hidden_states`, hs_connectors/transfer.py `FileTransfer`):
- `speculators train --on-missing generate --vllm-endpoint BASE/v1`: for each sample with no
  row file (hidden_states.py) under `--hidden-states-path`, the data loader sends POST /v1/completions
  {model, prompt: the row's input_ids, max_tokens: 1, return_token_ids: true}. `model` is
  `--verifier-name-or-path`, and the first model /v1/models lists must have exactly that id (else
  it raises): the server is started with `--served-model-name` = the trainer's --target path.
- The response's `kv_transfer_params.hidden_states_path` names the file vLLM's hidden-states
  connector wrote; the trainer opens that path on its *own* filesystem, waits for the `.lock`,
  checks token ids, length and finiteness, and deletes the file. So server and trainer share the
  staging directory at the same path (hs-connectors' mooncake backend is the alternative; NOTES).
- A failed sample is retried (`--max-retries` HTTP retries, 2^k s backoff, inside
  `--generation-validation-retries` + 1 round trips), then dropped from its batch; 20 drops in a row
  in one loader worker stop the run. `--on-generate cache` no longer exists in 0.9.0 (deprecated:
  states are always deleted): hybrid is ours (compat/online_generation.py keeps each generated sample
  as its row file in `OUTPUT/hidden_states_cache/`, where speculators' `get_cached` finds it).
- vLLM cannot tell which layers it extracts (/v1/models reports id, root and max_model_len only):
  `serve_target` writes a card (`eagle3-server.json`) into the staging directory, which the trainer
  finds beside the probe's file; without one, the user states `--layer-ids` and the manifest says so.

`check_server` runs before any heavy work: served model id, max-model-len against the longest row,
one probe request (the file lands where this machine reads it; [T, len(layer_ids), H], the row's
token ids, finite), the card (target config hash, layer ids) or the stated layer ids.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from safetensors import safe_open

from .errors import ConfigError, InputError, StageError
from .files import atomic_write_json, remove_path
from .hidden_states import StateFormat, hs_files
from .manifest import PrepareManifest
from .preflight import check_disk
from .prepared import load_prepared
from .target import load_target_info

# Local imports: extract.common, extract.vllm_backend: imported where the probe file is read (they load
# torch; this module's names are torch-free).

log = logging.getLogger("eagle3")

CARD_NAME = "eagle3-server.json"
CACHE_DIRNAME = "hidden_states_cache"  # hybrid: OUTPUT/hidden_states_cache/, one row file each (hidden_states.py)
STAGING_DIRNAME = "vllm_online_staging"  # serve_target's default staging dir, inside --data
SERVE_MODULE = "eagle3_pipeline.serve_target"
# What the compat fix (in every training process and loader worker) reads; set by training.export_compat_settings.
MODE_ENV = "EAGLE3_HIDDEN_STATES"
CACHE_ENV = "EAGLE3_HS_CACHE_DIR"
# The tag the compat fix puts in front of its one-line reason, so stage 04 finds it in speculators' error.
ENDPOINT_DOWN_TAG = "[eagle3: vllm endpoint down] "
PROBE_TIMEOUT_S = 120.0


def base_url(endpoint: str) -> str:
    """http://host:port (what people type) from http://host:port[/v1][/]."""
    url = endpoint.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_url(endpoint: str) -> str:
    """The OpenAI base URL speculators' client takes (`--vllm-endpoint`)."""
    return base_url(endpoint) + "/v1"


def cache_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / CACHE_DIRNAME


def speculators_args(cfg) -> list[str]:
    """The `speculators train` flags for online/hybrid (files mode passes `--on-missing raise`)."""
    endpoint = api_url(cfg.vllm_endpoint) if cfg.vllm_endpoint else "<--vllm-endpoint>"
    return ["--on-missing", "generate", "--vllm-endpoint", endpoint,
            # speculators reads cached samples here first: hybrid's cache (empty, and never written, online)
            "--hidden-states-path", str(cache_dir(cfg.output)),
            "--max-retries", str(cfg.vllm_retries), "--request-timeout", repr(float(cfg.vllm_request_timeout))]


def require_endpoint(cfg) -> str:
    if not cfg.vllm_endpoint:
        raise ConfigError(f"--hidden-states {cfg.hidden_states} needs --vllm-endpoint URL: a vLLM serving the target with "
                          f"hidden-state extraction (start it with: python -m {SERVE_MODULE} --help)")
    if not base_url(cfg.vllm_endpoint).startswith(("http://", "https://")):
        raise ConfigError(f"--vllm-endpoint {cfg.vllm_endpoint!r}: expected http://HOST:PORT")
    return base_url(cfg.vllm_endpoint)


# --- HTTP -----------------------------------------------------------------------------------

def _request(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def endpoint_problem(endpoint: str, timeout: float = 10.0) -> str | None:
    """Why the server does not answer /v1/models now (one line), or None."""
    try:
        _request(base_url(endpoint) + "/v1/models", timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return f"--vllm-endpoint {base_url(endpoint)} does not answer ({reason})"
    return None


def served_models(endpoint: str) -> list[dict]:
    try:
        models = _request(base_url(endpoint) + "/v1/models")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise StageError(f"--vllm-endpoint {base_url(endpoint)}: no vLLM server answers ({reason}); start it with "
                         f"python -m {SERVE_MODULE} (same --profile, --target and --data), wait for it to be ready, "
                         f"then rerun") from None
    data = models.get("data") if isinstance(models, dict) else None
    if not data:
        raise InputError(f"--vllm-endpoint {base_url(endpoint)}: /v1/models lists no model")
    return data


# --- the server's card (written by serve_target) --------------------------------------------------

def write_card(staging: Path, *, target, layer_ids: list[int], max_model_len: int, served_model_name: str,
               argv: list[str], host: str, port: int) -> Path:
    """What the server extracts, for the trainer to check (vLLM cannot report it)."""
    card = {
        "written_by": SERVE_MODULE, "pid": os.getpid(), "started": time.time(),
        "target": {"path": target.path, "config_sha256": target.config_sha256,
                   "tokenizer_sha256": target.tokenizer_sha256, "num_layers": target.num_layers,
                   "hidden_size": target.hidden_size},
        "layer_ids": list(layer_ids), "max_model_len": int(max_model_len),
        "served_model_name": served_model_name, "host": host, "port": int(port),
        "staging_dir": str(staging), "argv": list(argv),
    }
    path = Path(staging) / CARD_NAME
    atomic_write_json(path, card)
    return path


def read_card(path: Path) -> dict | None:
    try:
        card = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: unreadable server card ({str(exc)[:80]}); restart the server with "
                         f"python -m {SERVE_MODULE}") from None
    return card if isinstance(card, dict) else None


# --- the check before training ----------------------------------------------------------------------

def check_server(endpoint: str, target, layer_ids: list[int], layer_ids_stated: bool, probe_ids: list[int],
                 max_row_tokens: int) -> dict:
    """Refuse a server that would not feed this run the states stage 02 would have written.

    Returns what was checked (recorded in stage 04's manifest). `probe_ids`: one row of the prepared
    data (its states are requested once and deleted); `max_row_tokens`: the longest row.
    """
    from .extract.common import BadHiddenStates, validate_file
    from .extract.vllm_backend import wait_until_written

    url = base_url(endpoint)
    started = time.monotonic()
    model = served_models(url)[0]  # speculators uses the first model listed
    model_id, root, max_model_len = model.get("id"), model.get("root"), model.get("max_model_len")
    if model_id != target.path:
        raise InputError(f"--vllm-endpoint {url} serves model id {model_id!r}; speculators requests --target's path "
                         f"{target.path!r} and refuses any other id: restart it with python -m {SERVE_MODULE} "
                         f"(--served-model-name {target.path} when the server reads the target from another path)")
    if isinstance(max_model_len, int) and max_model_len < max_row_tokens + 1:
        raise InputError(f"--vllm-endpoint {url}: max_model_len {max_model_len} < the longest prepared row "
                         f"({max_row_tokens} tokens) + 1; restart it with --max-model-len >= {max_row_tokens + 1}")
    record: dict = {"endpoint": url, "model_id": model_id, "root": root, "max_model_len": max_model_len,
                    "checked": [f"served model id = --target ({model_id})",
                                f"max_model_len {max_model_len} >= longest row {max_row_tokens} + 1"]}

    # One probe: the file must land where this machine reads it, with the layers and ids of this run.
    body = {"model": model_id, "prompt": list(probe_ids), "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
    try:
        response = _request(url + "/v1/completions", body, timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        raise InputError(f"--vllm-endpoint {url}: the probe request failed (HTTP {exc.code}: {detail})") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise StageError(f"--vllm-endpoint {url}: the probe request failed ({getattr(exc, 'reason', exc)})") from None
    params = response.get("kv_transfer_params") or ((response.get("choices") or [{}])[0].get("kv_transfer_params"))
    path = (params or {}).get("hidden_states_path")
    if not path:
        raise InputError(f"--vllm-endpoint {url} returns no hidden_states_path: it was not started with hidden-state "
                         f"extraction (speculative method extract_hidden_states + the hidden-states connector); "
                         f"start it with python -m {SERVE_MODULE}")
    path = Path(path)
    try:
        if not path.parent.is_dir():
            raise InputError(f"--vllm-endpoint {url} writes hidden states to {path.parent}, which this machine cannot "
                             f"read: speculators' trainer opens the server's files at the same path (put the server's "
                             f"--staging-dir on a filesystem both machines mount there)")
        problem = wait_until_written(path, timeout=PROBE_TIMEOUT_S)
        if problem:
            raise InputError(f"--vllm-endpoint {url}: {problem}")
        try:
            validate_file(path, list(probe_ids), len(layer_ids), target.hidden_size)
        except BadHiddenStates as exc:
            raise InputError(f"--vllm-endpoint {url} extracts other hidden states than this run needs ({exc}); "
                             f"expected {len(layer_ids)} layers {layer_ids} of hidden size {target.hidden_size}") from None

        with safe_open(str(path), framework="pt") as handle:
            dtype = str(handle.get_slice("hidden_states").get_dtype())
    finally:
        remove_path(path)
        remove_path(path.with_name(path.name + ".lock"))
    record["probe"] = {"tokens": len(probe_ids), "slots": len(layer_ids), "hidden_size": target.hidden_size,
                       "dtype": dtype, "staging_dir": str(path.parent)}
    record["checked"].append(f"probe: {len(probe_ids)} tokens -> [{len(probe_ids)}, {len(layer_ids)}, "
                             f"{target.hidden_size}] {dtype} in {path.parent}, read here, token ids equal")

    card_path = path.parent / CARD_NAME
    card = read_card(card_path)
    if card is not None:
        if card.get("target", {}).get("config_sha256") != target.config_sha256:
            raise InputError(f"{card_path}: the server at {url} serves {card.get('target', {}).get('path')} (config "
                             f"hash {str(card.get('target', {}).get('config_sha256'))[:12]}), not --target {target.path} "
                             f"({target.config_sha256[:12]})")
        if list(card.get("layer_ids") or []) != list(layer_ids):
            raise InputError(f"{card_path}: the server at {url} extracts layer ids {card.get('layer_ids')}, this run "
                             f"needs {layer_ids} (--layer-ids, default 2, L//2, L-3 + L): restart the server with "
                             f"--layer-ids {' '.join(map(str, layer_ids[:-1]))}, or pass those of the server")
        record["card"] = str(card_path)
        record["layer_ids_from"] = f"server card {card_path}"
        record["checked"] += [f"target config hash {target.config_sha256[:12]} (server card)",
                              f"layer ids {layer_ids} (server card)"]
    elif layer_ids_stated:
        record["card"] = None
        record["layer_ids_from"] = "--layer-ids, stated by the user (the server has no card; vLLM cannot report them)"
        record["checked"].append(f"layer ids {layer_ids}: as stated with --layer-ids (not verifiable on the server)")
    else:
        raise ConfigError(f"--vllm-endpoint {url}: no server card at {card_path} (the server was not started with "
                          f"python -m {SERVE_MODULE}) and vLLM cannot report the layer ids it extracts: pass --layer-ids "
                          f"with the server's eagle_aux_hidden_state_layer_ids minus the final layer "
                          f"(this run's default: {' '.join(map(str, layer_ids[:-1]))})")
    if card is None and root and Path(root, "config.json").is_file():  # the server's own copy, readable here

        served = load_target_info(root)
        if served.config_sha256 != target.config_sha256:
            raise InputError(f"--vllm-endpoint {url} serves {root}, whose config.json differs from --target "
                             f"{target.path}'s")
        record["checked"].append(f"target config hash {target.config_sha256[:12]} (the server's {root}, read here)")
    record["seconds"] = round(time.monotonic() - started, 2)
    return record


def preflight(cfg, target, prepared: PrepareManifest, layer_ids: list[int], layer_ids_stated: bool) -> dict:
    """Stage 04's online/hybrid preflight: the server check (logged), and disk for hybrid's cache."""
    probe_ids, longest = probe_row(cfg.data)
    server = check_server(cfg.vllm_endpoint, target, layer_ids, layer_ids_stated, probe_ids, longest)
    server["mode"] = cfg.hidden_states
    log.info("preflight vllm: %s", "; ".join(server["checked"]))
    if cfg.hidden_states == "hybrid":
        dtype = server["probe"]["dtype"]
        need = cache_bytes_needed(prepared.counts.tokens, len(layer_ids), target.hidden_size, dtype, cfg.output)
        log.info("preflight %s", check_disk("", need, f"the hybrid cache ({CACHE_DIRNAME}/: every row's states, {dtype})",
                                            Path(cfg.output)))
    return server


def command_note(cfg) -> str:
    """command.txt's note: what 04 adds to the plain speculators call in online/hybrid mode."""
    kept = f"; every generated sample is kept in {CACHE_DIRNAME}/" if cfg.hidden_states == "hybrid" else ""
    return (f"--hidden-states {cfg.hidden_states}: 04_train.py also installs compat/online_generation.py (a server that "
            f"stops answering stops training at that batch{kept}); speculators alone drops the samples it cannot get "
            f"and keeps none")


def probe_row(data_dir: str | Path) -> tuple[list[int], int]:
    """The shortest prepared row's input_ids (the probe request) and the longest row's length."""
    dataset = load_prepared(Path(data_dir)).with_format(None)
    lengths = [int(n) for n in dataset["seq_len"]]
    shortest = min(range(len(lengths)), key=lengths.__getitem__)
    return [int(i) for i in dataset[shortest]["input_ids"]], max(lengths)


def cache_bytes_needed(total_tokens: int, slots: int, hidden_size: int, dtype: str, out_dir: Path) -> int:
    """Hybrid: bytes the cache still needs (what is already cached is subtracted). `dtype`: the probe file's."""
    need = total_tokens * StateFormat.from_stored(dtype).bytes_per_token(hidden_size, slots)
    have = sum(p.stat().st_size for p in hs_files(cache_dir(out_dir)))
    return max(need - have, 0)
