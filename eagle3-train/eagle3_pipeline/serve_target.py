"""The vLLM server for online/hybrid training: `python -m eagle3_pipeline.serve_target`.

It starts the target exactly as stage 02's vLLM backend runs it (`extract.vllm_backend.server_command`:
speculative method `extract_hidden_states` with the aux layer ids + the final layer L, the
hidden-states KV connector writing one safetensors file per request into the staging directory,
prefix caching off, language-model-only for a multimodal wrapper, our checked connector subclass
(compat/hidden_states_connector.py)), with stage 02's flags and the `extract` section of --profile, and adds what
speculators' online trainer needs:
- `--served-model-name`: speculators requests the model by the trainer's --target path and refuses
  any other id (default: this --target's resolved path, right when both boxes see the target at
  the same path);
- `--host` (default 127.0.0.1; 0.0.0.0 for a trainer on another machine) and `--server-port`;
- the staging directory (`--staging-dir`, default DATA/vllm_online_staging): the trainer opens
  the files at the path vLLM reports, so it must be on a filesystem the trainer mounts at the same
  path. One server per staging directory (locked); files a killed server left there are removed;
- the card `STAGING/eagle3-server.json` (target config hash, layer ids, max-model-len, the command):
  vLLM cannot report what it extracts, so stage 04 reads this beside the file of its probe request.

Then it replaces itself with the server (exec: same pid, so signals reach vLLM). `--print` prints the
command instead (nothing is written; stage 04 then needs --layer-ids, there being no card).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from .config.resolution import build_parser, resolve_parsed
from .config.schema import ExtractConfig
from .contract import read_manifest, require_equal
from .errors import ConfigError, StageError
from .extract.vllm_backend import engine_problem, layer_ids_problem, server_command, vllm_on_cpu, vllm_version_problem
from .files import LockedError, hold_lock, is_temp_path, remove_path
from .online import CARD_NAME, STAGING_DIRNAME, write_card
from .stage import log, stage_main
from .target import extraction_layer_ids, load_target_info

SERVE_LOCK = ".serve_target.lock"
EXAMPLE = ("python -m eagle3_pipeline.serve_target --profile b300-8x --target /models/Kimi-K2.5 --trust-remote-code \\\n"
           "    --data /shared/eagle3/data --staging-dir /shared/eagle3/staging --host 0.0.0.0 --server-port 8000")
# Stage 02 flags that do not shape the server (accepted, so one command line fits both; ignored, hidden in --help).
_NOT_SERVING = ("backend", "device", "max_samples", "world_size", "rank", "retries", "validate_only",
                "validate_sample", "check", "endpoint", "print_server_cmd")


def parse(argv: list[str] | None):
    parser = build_parser(ExtractConfig)
    for action in parser._actions:  # accepted (one command line fits both), not shown
        if action.dest in _NOT_SERVING:
            action.help = argparse.SUPPRESS
    parser.description = ("Start vLLM serving the target with hidden-state extraction for 04_train.py --hidden-states "
                          "online/hybrid, with stage 02's vLLM settings (its flags and the profile's 'extract' "
                          "section; flags that do not shape the server are ignored).")
    parser.epilog = (f"example (box A serves, box B trains with --vllm-endpoint http://box-a:8000):\n  {EXAMPLE}\n\n"
                     "precedence: default < --profile < flag")
    parser.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 when the trainer runs elsewhere)")
    parser.add_argument("--served-model-name", help="model id the server reports: the trainer's --target path "
                                                    "(default: this --target's resolved path)")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print the vLLM command and exit (writes no card: stage 04 then needs --layer-ids)")
    args = vars(parser.parse_args(argv))
    extra = {key: args.pop(key, default) for key, default in
             (("host", "127.0.0.1"), ("served_model_name", None), ("print_only", False))}
    cfg, _ = resolve_parsed(ExtractConfig, args)
    return cfg, extra


@stage_main
def main(argv: list[str] | None = None) -> int:
    cfg, extra = parse(argv)
    if cfg.storage != "dtype":
        raise ConfigError("--storage fp8: online training reads the states as vLLM writes them; serve with --storage dtype")
    target = load_target_info(cfg.target)
    prepared = read_manifest(cfg.data, "prepare", "--data")
    hint = "serve the --target stage 01 prepared the data for"
    require_equal("target config", target.config_sha256, prepared.target["config_sha256"], prepared, hint)
    require_equal("tokenizer", target.tokenizer_sha256, prepared.target["tokenizer_sha256"], prepared, hint)
    layer_ids = extraction_layer_ids(target.num_layers, cfg.layer_ids)
    for problem in (layer_ids_problem(target, layer_ids),
                    vllm_version_problem(target, cfg.tensor_parallel_size, cfg.kv_cache_dtype)):
        if problem:
            raise StageError(problem)
    on_cpu = vllm_on_cpu()
    if problem := engine_problem(on_cpu):
        raise StageError(problem)
    max_model_len = cfg.max_model_len or prepared.max_seq_len + 1
    staging = Path(cfg.staging_dir or Path(cfg.data) / STAGING_DIRNAME).resolve()
    served = extra["served_model_name"] or target.path
    argv_server = server_command(cfg, target, layer_ids, staging, max_model_len, on_cpu=on_cpu, host=extra["host"],
                                 served_model_name=served if served != target.path else None)
    if extra["print_only"]:
        print(shlex.join(argv_server))
        log.info("this command writes no %s: pass 04_train.py --layer-ids %s (the ids above, without %d)", CARD_NAME,
                 " ".join(map(str, layer_ids[:-1])), layer_ids[-1])
        return 0

    staging.mkdir(parents=True, exist_ok=True)
    try:
        hold_lock(staging / SERVE_LOCK)  # inherited across exec: held by the server while it lives
    except LockedError:
        raise StageError(f"{staging}: another server uses this staging directory (it holds {staging / SERVE_LOCK}); "
                         f"stop it or pass another --staging-dir") from None
    leftovers = [p for p in staging.iterdir() if p.name != SERVE_LOCK
                 and (p.suffix in (".safetensors", ".lock") or is_temp_path(p) or p.name == CARD_NAME)]
    for path in leftovers:  # a killed server's files: nobody will read them
        remove_path(path)
    card = write_card(staging, target=target, layer_ids=layer_ids, max_model_len=max_model_len,
                      served_model_name=served, argv=argv_server, host=extra["host"], port=cfg.server_port)
    log.info("serving %s for online training: layer ids %s, max-model-len %d, model id %s, files in %s (card %s; "
             "%d leftover file(s) removed)", target.path, layer_ids, max_model_len, served, staging, card.name,
             len(leftovers))
    log.info("exec: %s", shlex.join(argv_server))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(argv_server[0], argv_server)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
