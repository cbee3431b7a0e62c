"""The README's picture of the dashboard: `pagedkv serve` on CPU under a small mixed load, its page
in headless Chromium, one request selected, a screenshot.

The load, on a pool of 128 MiB (SmolLM2 fp32: about 180 blocks of 16 tokens):
- first, three chat requests with one system prompt, finished: their blocks stay cached;
- then, at once: a request of ``n=3`` samples (their prompt blocks shared, refcount 3; their
  copy-on-write tails apart), two more chat requests with that system prompt (its cached blocks
  shared again), and two plain completions;
- after about 30 seconds of watching (the charts get their first points), the ``n=3`` request is
  selected and the page is saved as a PNG.

    python scripts/dashboard_screenshot.py [--out docs/images/dashboard.png]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from headless_chromium import chromium, log_in  # noqa: E402 - scripts/ is not a package

from client.ops.stack import ServiceProcess  # noqa: E402

KEY = "screenshot-operator"
SYSTEM = ("You are a careful assistant for a team that runs language models on shared machines. "
          "Answer in plain words, name the units of every number, and say when you are not sure.")
QUESTIONS = ["What is a block table?", "Why share prompt blocks?", "What does copy-on-write copy?",
             "When is a cached block evicted?", "What is preemption?"]


def post(url: str, body: dict, stop: threading.Event) -> None:
    """One streamed request, read until it ends or ``stop`` is set (then the server aborts it)."""
    with httpx.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            if stop.is_set():
                return


def chat(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": 1, "ignore_eos": True, "stream": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "dashboard.png")
    ap.add_argument("--watch", type=float, default=30.0, help="seconds of load before the screenshot")
    args = ap.parse_args(argv)

    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="pagedkv-screenshot-") as tmp:
        srv = ServiceProcess.pagedkv(["serve", "--device", "cpu", "--admin-api-key", KEY, "--kv-cache-memory", "128MiB",
                                      "--max-num-seqs", "16"], Path(tmp), "serve", cwd=ROOT, timeout=300)
        url = f"http://{srv.address}"
        threads: list[threading.Thread] = []
        driver = None
        try:
            for q in QUESTIONS[:3]:  # finished: their blocks stay in the prefix cache
                post(f"{url}/v1/chat/completions", chat(q, 8), stop)
            driver = chromium(1400, 1150, browser_log=False)
            log_in(driver, url, KEY)
            loads = [("/v1/completions", {"prompt": "Write a short story about a lighthouse keeper who finds a "
                                                    "message in a bottle, and what she does next:", "n": 3,
                                          "max_tokens": 400, "temperature": 0.9, "seed": 7, "ignore_eos": True,
                                          "stream": True}),
                     ("/v1/chat/completions", chat(QUESTIONS[3], 400)),
                     ("/v1/chat/completions", chat(QUESTIONS[4], 400)),
                     ("/v1/completions", {"prompt": "The three parts of a paged KV cache are", "max_tokens": 400,
                                          "ignore_eos": True, "stream": True}),
                     ("/v1/completions", {"prompt": "List the planets of the solar system:", "max_tokens": 400,
                                          "ignore_eos": True, "stream": True})]
            for path, body in loads:
                t = threading.Thread(target=post, args=(url + path, body, stop), daemon=True)
                t.start()
                threads.append(t)
            time.sleep(args.watch)
            rows = driver.execute_script("return [...document.querySelectorAll('#requests tr[data-request]')]"
                                         ".filter(r => r.children[2].textContent === '2').map(r => r.dataset.seq)")
            if rows:  # the request with a third sample is the n=3 one
                driver.execute_script(f"document.querySelector(\"#requests tr[data-seq='{rows[0]}']\").click()")
                time.sleep(1.0)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
            print(f"wrote {args.out}")
        finally:
            stop.set()
            if driver is not None:
                driver.quit()
            for t in threads:
                t.join(timeout=60)
            srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
