"""The engine adapters' `kvd_` settings (vLLM's kv_connector_extra_config, SGLang's storage
extra_config): read strictly, each wrong one named in one line. The adapters themselves
read them through the engines' real classes in the engine tier (tests/engines)."""

from __future__ import annotations

import math

import pytest

from kvd_client.adapter_settings import SglangSettings, VllmSettings, read_settings


def test_defaults_and_the_engines_own_keys():
    extra = {"backend_name": "kvd", "interface_v1": 1, "kvd_target": "unix:///k.sock"}
    s = read_settings(SglangSettings, extra, "extra_config")
    assert (s.kvd_target, s.kvd_timeout_s, s.kvd_retry_s, s.kvd_slice_pages) == (
        "unix:///k.sock", 5.0, 1.0, 0)
    v = read_settings(VllmSettings, None, "kv_connector_extra_config")
    assert (v.kvd_timeout_s, v.kvd_save_output, v.kvd_load_failure_policy,
            v.kvd_queue_poll_s, v.kvd_lookup_again_s) == (2.0, False, "recompute", 0.05, 0.5)
    good = read_settings(VllmSettings, {"kvd_timeout_s": 3, "kvd_retry_s": 0,
                                        "kvd_load_failure_policy": "fail",
                                        "kvd_tenants": "a,b", "kvd_save_output": True}, "x")
    assert (good.kvd_timeout_s, good.kvd_retry_s, good.kvd_load_failure_policy,
            good.kvd_save_output) == (3.0, 0.0, "fail", True)


@pytest.mark.parametrize("kind, key, value, says", [
    # Each of these was taken by float() or int(), or passed on unread: a negative or zero
    # timeout failed every call (the engine then ran without kvd and said nothing), a
    # negative slice stored nothing, an unknown policy went into vLLM's config unchecked.
    (VllmSettings, "kvd_timeout_s", -1, "greater than 0"),
    (VllmSettings, "kvd_timeout_s", 0, "greater than 0"),
    (VllmSettings, "kvd_timeout_s", math.nan, "finite number"),
    (VllmSettings, "kvd_timeout_s", "2", "valid number"),
    (VllmSettings, "kvd_timeout_s", True, "valid number"),
    (VllmSettings, "kvd_retry_s", -0.5, "greater than or equal to 0"),
    (VllmSettings, "kvd_queue_poll_s", 0, "greater than 0"),
    (VllmSettings, "kvd_lookup_again_s", math.inf, "finite number"),
    (VllmSettings, "kvd_load_failure_policy", "retry", "'recompute' or 'fail'"),
    (VllmSettings, "kvd_save_output", "true", "valid boolean"),
    (VllmSettings, "kvd_target", 7, "valid string"),
    (VllmSettings, "kvd_timout_s", 3, "not a setting of this adapter"),
    (VllmSettings, "kvd_slice_pages", 8, "not a setting of this adapter"),  # SGLang's
    (SglangSettings, "kvd_slice_pages", -5, "greater than or equal to 0"),
    (SglangSettings, "kvd_slice_pages", 1.5, "valid integer"),
    (SglangSettings, "kvd_namespace", 3, "valid string"),
    (SglangSettings, "kvd_save_output", True, "not a setting of this adapter"),  # vLLM's
])
def test_a_wrong_setting_is_one_line_naming_it(kind, key, value, says):
    with pytest.raises(ValueError) as err:
        read_settings(kind, {"kvd_target": "unix:///k.sock", key: value}, "extra_config")
    message = str(err.value)
    assert message.startswith(f"extra_config: {key}: ") and says in message, message
    assert "\n" not in message


def test_a_token_file_that_cannot_be_read_is_named(tmp_path):
    (tmp_path / "t").write_text("secret\n")
    assert read_settings(VllmSettings, {"kvd_token_file": str(tmp_path / "t")},
                         "x").token() == "secret"
    assert read_settings(VllmSettings, {"kvd_token": "a", "kvd_token_file": "/nowhere"},
                         "x").token() == "a"
    with pytest.raises(ValueError, match=f"kvd_token_file {tmp_path}/gone: cannot read it"):
        read_settings(VllmSettings, {"kvd_token_file": str(tmp_path / "gone")}, "x").token()
