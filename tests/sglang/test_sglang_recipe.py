"""docs/sglang.md's recipe, as the real-server test (slow) reads it: checked
in CI in milliseconds, so a doc edit the test could not run fails here too."""

from __future__ import annotations

from pathlib import Path

from sglang_servers import MODEL_SCRIPT, ROOT, on_gpus, option, read_recipe


def test_the_docs_recipe_is_a_prefill_a_decode_and_sglangs_router_over_kvconn() -> None:
    recipe = read_recipe()
    for argv, mode in ((recipe.prefill, "prefill"), (recipe.decode, "decode")):
        assert argv[1:3] == ("-m", "sglang.launch_server")
        assert option(argv, "--disaggregation-mode") == mode
        assert option(argv, "--disaggregation-transfer-backend") == "kvconn"
        assert option(argv, "--model-path") == "MODEL"
        assert "--enable-metrics" in argv
    assert recipe.router[1:4] == ("-m", "sglang_router.launch_router", "--pd-disaggregation")
    # The router names the prefill's HTTP port and bootstrap port, and decode's.
    prefill_at = option(recipe.router, "--prefill")
    assert prefill_at == f"http://127.0.0.1:{option(recipe.prefill, '--port')}"
    assert option(recipe.router, prefill_at) == option(recipe.prefill, "--disaggregation-bootstrap-port")
    assert option(recipe.router, "--decode") == f"http://127.0.0.1:{option(recipe.decode, '--port')}"
    assert recipe.client_url == f"http://127.0.0.1:{option(recipe.router, '--port')}/generate"
    assert recipe.client_body["sampling_params"]["temperature"] == 0
    assert recipe.env["SGLANG_USE_CPU_ENGINE"] == "1"
    # the model is made by the doc's own line, into the folder the servers serve
    assert recipe.model[1:] == (str(ROOT / MODEL_SCRIPT), "MODEL")


def test_the_test_binds_the_recipe_to_its_model_and_ports_and_derives_the_plain_server() -> None:
    recipe = read_recipe()
    ports = {p: 40000 + i for i, p in enumerate(recipe.ports())}
    bound = recipe.bound(Path("/models/tiny"), ports)
    assert option(bound.prefill, "--model-path") == "/models/tiny"
    assert bound.model[-1] == "/models/tiny"
    assert sorted(bound.ports()) == sorted(ports.values())
    assert option(bound.router, "--prefill").endswith(option(bound.prefill, "--port"))
    plain = bound.plain()
    assert not any(a.startswith("--disaggregation-") for a in plain)
    assert option(plain, "--port") == option(bound.prefill, "--port")
    assert "--skip-tokenizer-init" in plain and option(plain, "--device") == "cpu"


def test_on_a_gpu_host_the_cpu_settings_are_dropped() -> None:
    gpu = on_gpus(read_recipe(), 0, 1)
    assert "SGLANG_USE_CPU_ENGINE" not in gpu.env and "PYTHONPATH" not in gpu.env
    assert "--device" not in gpu.prefill and "--disaggregation-decode-retraction-backup" not in gpu.decode
    assert option(gpu.prefill, "--dtype") == "bfloat16"
    assert option(gpu.prefill, "--base-gpu-id") == "0" and option(gpu.decode, "--base-gpu-id") == "1"
    assert option(gpu.decode, "--disaggregation-transfer-backend") == "kvconn"
