"""The run plan (eagle3_pipeline.plan): bytes, disk, read bandwidth, hours and the recommendation."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.contract import write_manifest
from eagle3_pipeline.manifest import ExtractCounts, ExtractManifest, PrepareCounts, PrepareManifest
from eagle3_pipeline.plan import bytes_per_token, format_plan, main, make_plan

KIMI_TEXT = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}


@pytest.fixture()
def kimi_config(tmp_path):
    """Kimi-K2.5's config is all a plan needs (no weights)."""
    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": KIMI_TEXT}))
    return target


def test_bytes_per_token_are_kimis_57344_in_bf16_and_half_plus_a_scale_in_fp8():
    assert bytes_per_token(7168, "bf16") == 4 * 7168 * 2 == 57_344
    assert bytes_per_token(7168, "fp8") == 4 * 7168 + 4


def test_a_100k_x_2k_run_needs_11_7_tb_in_bf16_and_reads_at_8_gpus_times_the_training_rate(kimi_config, tmp_path):
    plan = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"), rows=100_000, tokens_per_row=2048,
                     train_tokens_per_s=30_000, disk_read_gb_s=2.0)
    assert plan.tokens == 204_800_000 and plan.gpus == 8
    assert plan.total_bytes == {"bf16": 204_800_000 * 57_344, "fp8": 204_800_000 * 28_676}
    assert plan.need_gb_s("bf16") == pytest.approx(8 * 30_000 * 57_344 / 1e9)
    # the disk (2 GB/s) is slower than 8 GPUs read: training hours are disk-bound, fp8 halves them
    assert plan.train_hours("bf16") == pytest.approx(204_800_000 * plan.epochs / (2e9 / 57_344) / 3600)
    assert plan.train_hours("fp8") < plan.train_hours("bf16") / 1.9
    text = format_plan(plan)
    assert "11.7 TB" in text and "does NOT fit" in text and "04_train.py --hidden-states online" in text


def test_a_small_run_on_a_fast_disk_is_told_bf16_files(kimi_config, tmp_path):
    plan = make_plan(str(kimi_config), "cpu-mini", str(tmp_path / "w"), rows=10, tokens_per_row=100, disk_read_gb_s=100.0)
    assert plan.recommendation.startswith("bf16 hidden-state files")


def test_rows_come_from_stage_01s_manifest_when_the_data_is_prepared(kimi_config, tmp_path, capsys):
    (tmp_path / "w" / "data").mkdir(parents=True)
    write_manifest(tmp_path / "w" / "data", PrepareManifest(counts=PrepareCounts(rows=7, tokens=700)))
    assert main(["--target", str(kimi_config), "--profile", "cpu-mini", "--work", str(tmp_path / "w"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["rows"], plan["tokens"]) == (7, 700) and "stage 01's" in plan["tokens_source"]
    assert plan["disk_read_gb_s"] is None and plan["disk_read_source"].startswith("not measured")


def test_no_data_and_no_hypothetical_rows_is_one_line(kimi_config, tmp_path, capsys):
    assert main(["--target", str(kimi_config), "--profile", "cpu-mini", "--work", str(tmp_path / "w")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "--rows and --tokens-per-row" in err and "\n" not in err
    assert not (tmp_path / "w").exists()  # a plan writes nothing


def test_run_all_plan_prints_the_plan_for_the_profile_and_writes_nothing(kimi_config, tmp_path):
    import subprocess
    import sys

    from conftest import SCRIPTS

    work = tmp_path / "w"
    result = subprocess.run(["bash", str(SCRIPTS / "run_all.sh"), "--plan", "--profile", "rtx-pro-6000-8x", "--target",
                             str(kimi_config), "--work", str(work), "--rows", "100000", "--tokens-per-row", "2048",
                             "--python", sys.executable], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "profile rtx-pro-6000-8x: 8 training GPU(s)" in result.stdout and "204,800,000 tokens" in result.stdout
    assert "recommendation:" in result.stdout and not work.exists()


def test_every_stage_has_hours_with_stated_rates_and_their_sources(kimi_config, tmp_path):
    plan = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"), rows=100_000, tokens_per_row=2048,
                     extract_tokens_per_s=80_000, decode_tokens_per_s=20_000, answer_tokens_per_row=1024,
                     disk_read_gb_s=2.0)
    assert plan.answer_tokens == 100_000 * 1024
    assert plan.regen_hours() == pytest.approx(100_000 * 1024 / 20_000 / 3600)
    assert plan.extract_hours() == pytest.approx(204_800_000 / 80_000 / 3600)
    modes = plan.mode_hours()
    assert modes["bf16"] == pytest.approx(plan.extract_hours() + plan.train_hours("bf16"))
    assert modes["fp8"] == pytest.approx(plan.extract_hours() + plan.train_hours("fp8"))
    gpu_epoch = 204_800_000 / (8 * plan.train_tokens_per_s_per_gpu) / 3600
    assert modes["online"] == pytest.approx(plan.epochs * max(plan.extract_hours(), gpu_epoch))
    text = format_plan(plan)
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines()}
    assert "1.4 h at 20,000 decode tokens/s (--decode-tokens-per-s)" in lines["regeneration"]
    assert "bf16 0.7 h at 80,000 tokens/s (the prefill; the disk's write rate not given)" in lines["extraction"]
    assert "prefill 80,000 tokens/s (--extract-tokens-per-s)" in lines["extraction"]
    assert "?" not in lines["disk x hours"] and "online 0 B" in lines["disk x hours"]


def test_extraction_hours_use_the_slower_of_the_prefill_and_the_disks_bytes(kimi_config, tmp_path):
    """At Kimi-K2.5's width stage 02 writes 57,344 B/token (bf16): a 2 GB/s disk takes ~34,900 tokens/s, below an
    80,000 tokens/s prefill (the disk governs bf16), while fp8's half the bytes still fit under a slower prefill.
    --extract-disk-fraction 1 plans at the disk's bound itself."""
    plan = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"), rows=100_000, tokens_per_row=2048,
                     extract_tokens_per_s=50_000, disk_write_gb_s=2.0, extract_disk_fraction=1.0)
    disk_bf16 = 2.0e9 / plan.bytes_per_token["bf16"]
    assert plan.extract_rate("bf16") == (pytest.approx(disk_bf16), "disk")
    assert plan.extract_rate("fp8") == (50_000, "prefill")  # 2e9 / 28,676 B = 69,700 tokens/s > 50,000
    assert plan.extract_hours("bf16") == pytest.approx(204_800_000 / disk_bf16 / 3600)
    assert plan.mode_hours()["fp8"] == pytest.approx(204_800_000 / 50_000 / 3600 + plan.train_hours("fp8"))
    extraction = next(line for line in format_plan(plan).splitlines() if line.strip().startswith("extraction:"))
    assert f"bf16 {plan.extract_hours('bf16'):,.1f} h at {disk_bf16:,.0f} tokens/s (disk governs)" in extraction
    assert "fp8 1.1 h at 50,000 tokens/s (prefill governs)" in extraction and "2.00 GB/s (--disk-write-gb-s)" in extraction
    assert "bf16 1.000, fp8 1.000; --extract-disk-fraction" in extraction


def test_the_disk_bound_is_priced_at_stage_02s_measured_fraction_of_it(kimi_config, tmp_path):
    """Stage 02 does not keep the disk busy all the time: by default the plan takes the disk's write rate times the
    ratio_to_bound that stage 02 reached at Kimi-K2.5's width on the H200 (per format, read from the results file), so
    the disk can govern where the bound alone would leave it to the prefill."""
    from eagle3_pipeline.plan import BENCH_STORAGES, EXTRACTION_RESULTS

    storages = json.loads(EXTRACTION_RESULTS.read_text())["targets"]["kimi-width"]["storages"]
    measured = {s: storages[bench]["ratio_to_bound"] for s, bench in BENCH_STORAGES.items()}
    assert all(0.5 < f < 1 for f in measured.values())  # the file's figures, below the bound
    # a prefill between the measured rate and the bound: the bound alone says the prefill governs, the measured
    # fraction says the disk does
    bound_bf16 = 2.0e9 / 57_344
    prefill = bound_bf16 * (1 + measured["bf16"]) / 2
    plan = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"), rows=100_000, tokens_per_row=2048,
                     extract_tokens_per_s=prefill, disk_write_gb_s=2.0)
    assert plan.disk_fraction == measured
    assert plan.extract_rate("bf16") == (pytest.approx(bound_bf16 * measured["bf16"]), "disk")
    assert plan.extract_rate("fp8") == (pytest.approx(prefill), "prefill")
    extraction = next(line for line in format_plan(plan).splitlines() if line.strip().startswith("extraction:"))
    assert f"bf16 {measured['bf16']:.3f}, fp8 {measured['fp8']:.3f}" in extraction
    assert "bench/results/h200-extraction-kimi-width-writeback-ab.json, ratio_to_bound" in extraction
    # the same plan at the bound itself: the prefill governs both
    at_bound = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"), rows=100_000, tokens_per_row=2048,
                         extract_tokens_per_s=prefill, disk_write_gb_s=2.0, extract_disk_fraction=1.0)
    assert at_bound.extract_rate("bf16") == (pytest.approx(prefill), "prefill")


def test_without_the_results_file_the_plan_says_it_prices_the_bound_itself(tmp_path):
    from eagle3_pipeline.plan import disk_fractions

    fractions, source = disk_fractions(results=tmp_path / "none.json")
    assert fractions == {"bf16": 1.0, "fp8": 1.0} and source.startswith("not measured: needs ")
    assert disk_fractions(0.8)[0] == {"bf16": 0.8, "fp8": 0.8}
    with pytest.raises(SystemExit):  # argparse refuses a fraction outside (0, 1]
        main(["--target", str(tmp_path), "--profile", "cpu-mini", "--work", str(tmp_path), "--extract-disk-fraction", "1.5"])


def test_extraction_rate_is_read_from_a_10_sample_stage_02s_manifest(kimi_config, tmp_path):
    hs = tmp_path / "w" / "data" / "hidden_states"
    hs.mkdir(parents=True)
    write_manifest(tmp_path / "w" / "data", PrepareManifest(counts=PrepareCounts(rows=10, tokens=20_000,
                                                                                  loss_tokens=12_000)))
    write_manifest(hs, ExtractManifest(counts=ExtractCounts(rows=10, tokens=20_000, extracted_tokens=20_000,
                                                            extract_s=4.0, extract_tokens_per_s=5000.0)))
    plan = make_plan(str(kimi_config), "b300-8x", str(tmp_path / "w"))
    assert plan.extract_tokens_per_s == 5000.0 and plan.extract_rate_source.startswith("measured: stage 02")
    assert plan.answer_tokens == 12_000 and "loss tokens" in plan.answer_tokens_source
    # no decode rate: the line says how to get one instead of an hour figure
    assert "give --decode-tokens-per-s" in format_plan(plan)


def test_run_all_plan_passes_the_rates_through(kimi_config, tmp_path):
    import subprocess
    import sys

    from conftest import SCRIPTS

    result = subprocess.run(["bash", str(SCRIPTS / "run_all.sh"), "--plan", "--profile", "b300-8x", "--target",
                             str(kimi_config), "--work", str(tmp_path / "w"), "--rows", "100000", "--tokens-per-row",
                             "2048", "--decode-tokens-per-s", "20000", "--extract-tokens-per-s", "80000",
                             "--disk-write-gb-s", "1.5", "--extract-disk-fraction", "0.5", "--python", sys.executable],
                            capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "(--decode-tokens-per-s)" in result.stdout and "(--extract-tokens-per-s)" in result.stdout
    assert "1.50 GB/s (--disk-write-gb-s)" in result.stdout and "bf16 0.500, fp8 0.500; --extract-disk-fraction" in result.stdout


@pytest.mark.parametrize("damage", ["cut short", "not complete"])
def test_a_damaged_data_manifest_is_named_never_no_prepared_data(kimi_config, tmp_path, capsys, damage):
    """Issue 46 K: before, `--plan` over a prepared WORK/data whose manifest was cut short (or left unfinished) said
    "no prepared data yet", although the data was there."""
    data = tmp_path / "w" / "data"
    data.mkdir(parents=True)
    manifest = write_manifest(data, PrepareManifest(counts=PrepareCounts(rows=7, tokens=700),
                                                    complete=damage != "not complete"))
    if damage == "cut short":
        manifest.path.write_bytes(manifest.path.read_bytes()[:200])
    assert main(["--target", str(kimi_config), "--profile", "cpu-mini", "--work", str(tmp_path / "w")]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {data / 'manifest.json'}: ") and "\n" not in err, err
    assert "no prepared data yet" not in err
    assert ("unreadable manifest" if damage == "cut short" else "stage 01 did not finish") in err, err
    assert "rerun 01_prepare_dataset.py" in err and "--rows and --tokens-per-row" in err
