"""bench/fast_restart.py's pure parts (issue 22 item 6): the downtime from the client's gaps, the
journal's spans, the memory order from the GPU samples, the summary and the profiles' sources. The
run itself needs a lab (`python3 bench/fast_restart.py --quick`, < 2 min)."""

from __future__ import annotations

import doctest

from bench import fast_restart as fr


def test_doctests():
    assert doctest.testmod(fr).failed == 0


def test_the_scripts_run_elsewhere_compile():
    for name in ("CLIENT", "POLLER", "JOURNAL"):
        compile(getattr(fr, name), name, "exec")


def test_every_configured_time_has_a_source_and_quick_scales_the_times_only():
    for name, profile in fr.PROFILES.items():
        for key, (value, source) in dict(fr.MECHANICS, **profile["env"]).items():
            float(value)
            assert key.startswith("SGLANG_STANDIN_") and len(source) > 10, (name, key)
    quick = fr.quick(fr.PROFILES["lab"])
    env = fr.profile_env(quick)
    assert float(env["SGLANG_STANDIN_WEIGHT_LOAD_S"]) == 306 / fr.QUICK_SCALE
    assert env["SGLANG_STANDIN_WEIGHT_MIB"] == "56028" and env["SGLANG_STANDIN_LOAD_S"] == "0"


def test_the_figures_and_the_summary_of_a_run():
    last, first = 100.0, 130.0

    def sample(way, flags, down, old_gone, new_kv):
        record = {"way": way, "flags": flags, "rc": 0, "wall_s": down + 3,
                  "downtime": {"s": down, "last_old_ok": last, "first_new_ok": last + down},
                  "journal_spans": {"drain": {"begin": 95.0, "end": 100.2, "s": 5.2},
                                    "gate": {"begin": 100.25, "end": 100.4, "s": 0.15}},
                  "memory": {"old_gone_t": old_gone, "new_kv_t": new_kv, "old_gone_before_new_kv": old_gone < new_kv}}
        record["figures"] = fr.figures(record)
        return record

    fp8, base = {"tp": 1, "kv-cache-dtype": "fp8_e4m3"}, {"tp": 1}
    doc = {"ways": {"a": {"samples": [sample("a", fp8, 40.0, 100.3, 125.0), sample("a", base, 44.0, 100.3, 126.0)]},
                    "c": {"samples": [sample("c", fp8, 8.0, 100.3, 104.0)]}}}
    record = doc["ways"]["a"]["samples"][0]
    assert record["figures"]["after_last_old_answer_s"]["old_exited"] == 0.2
    assert record["figures"]["after_last_old_answer_s"]["memory_new_kv"] == 25.0
    assert first - last == 30.0
    summary = fr.summarize(doc)
    assert summary["a"]["median_s"] == 42.0 and summary["a"]["median_to_fp8_s"] == 40.0
    assert summary["c_over_a"] == round(8.0 / 42.0, 3) and summary["target_c_at_most_a_over_5"] is True
    assert "| (c) weight cache + gated launch | 1 | 8.0 s |" in fr.report(dict(doc, summary=summary))
