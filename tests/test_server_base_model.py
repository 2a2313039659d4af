"""A model that ships no chat template (a base model) is served as llama.cpp and vLLM serve one:
the daemon starts, /v1/completions answers, and the chat endpoints answer 400 saying why
(never a 500, and no refusal to start)."""

from __future__ import annotations

import json
import shutil

from server_support.daemon import start_daemon


def _strip_templates(d):
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (d / "chat_template.json").unlink(missing_ok=True)


def test_a_model_without_a_chat_template_serves_completions(builtin_model_dir, tmp_path):
    d = tmp_path / "base"
    shutil.copytree(builtin_model_dir, d)  # the built-in model, its template taken out
    _strip_templates(d)
    daemon = start_daemon("--model", str(d), "--max-model-len", "128", "--kv-tokens", "512")
    try:
        body = {"model": daemon.model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        status, out = daemon.post("/v1/completions", body)
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 4
        chat = {"model": daemon.model, "messages": [{"role": "user", "content": "hi"}]}
        status, out = daemon.post("/v1/chat/completions", {**chat, "max_tokens": 4})
        assert status == 400, out
        assert "no chat template" in out["error"]["message"]
        assert "/v1/completions" in out["error"]["message"]
        status, out = daemon.post(
            "/v1/messages", {**chat, "max_tokens": 4}, headers={"anthropic-version": "2023-06-01"}
        )
        assert status == 400 and "no chat template" in json.dumps(out), out
        assert any("chat requests will be refused" in line for line in daemon.log)
    finally:
        assert daemon.stop() == 0
