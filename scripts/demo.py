"""The main job, end to end: ``make demo``.

Starts a memory service and a compute worker on this machine (``pagedkv up``:
CPU by default, GPU when present), generates answers to real chat prompts of
different lengths together (continuous batching; one prompt sampled n=3, its
prompt prefilled once and forked copy-on-write), prints the answers, tokens/s
and the block tables captured while the three samples shared their prompt
blocks, then stops the services (``pagedkv down``).

    python scripts/demo.py [--quick] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PAGEDKV_LOG_LEVEL", "warning")

from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from client.ops import launcher  # noqa: E402
from client.ops.report import sequences_table, stats_table  # noqa: E402
from client.params import SamplingParams  # noqa: E402

PROMPTS = [
    ("capital", "What is the capital of France?"),
    ("haiku", "Write a haiku about memory."),
    ("paging", "Explain in two sentences why an operating system uses virtual memory pages."),
    ("recipe", "Give me a short recipe for pancakes."),
    ("python", "Write a Python function that returns the squares of a list of numbers."),
    ("story", "Tell a very short story about a robot who learns to paint. Keep it under five sentences."),
    ("math", "What is 17 times 23? Answer with the number and one sentence."),
    ("advice", "I have a job interview tomorrow for a software engineering position at a company that builds "
               "databases. I am nervous because I have never worked on storage engines before, although I know "
               "data structures well. What three things should I prepare tonight?"),
]
SAMPLED = "story"  # this prompt is sampled n=3


class Monitor(threading.Thread):
    """Polls the memory service while generating; keeps the snapshot with the most shared blocks."""

    def __init__(self, llm, names: dict[str, str]):
        super().__init__(daemon=True)
        self.llm, self.names = llm, names
        self.best = None  # (shared refs, stats, sequences, labels)
        self.peak_used = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                stats, seqs = self.llm.memory.stats(), self.llm.memory.sequences(self.llm.lease_id)
            except Exception:  # noqa: BLE001 - a display thread never fails the demo
                continue
            self.peak_used = max(self.peak_used, stats.used_blocks)
            labels = {}
            for req in self.llm.engine_stats().running:
                for s in list(req.seqs):
                    if s.seq_id is not None:
                        labels[s.seq_id] = f"{self.names.get(req.request_id, '?')}[{s.index}]"
            if self.best is None or stats.shared_block_refs > self.best[0]:
                self.best = (stats.shared_block_refs, stats, seqs, labels)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (CI)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--memory-port", type=int, default=50051)
    parser.add_argument("--worker-port", type=int, default=50052)
    args = parser.parse_args()
    prompts = PROMPTS[:4] + [p for p in PROMPTS if p[0] == SAMPLED] if args.quick else PROMPTS
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    console = Console(width=140)

    console.rule("[bold]pagedkv demo")
    t = time.perf_counter()
    launcher.down()
    state = launcher.up(memory_port=args.memory_port, worker_port=args.worker_port)
    console.print(f"memory service {state['memory']['address']} and worker {state['workers'][0]['address']} "
                  f"up on [bold]{state['device']}[/] in {time.perf_counter() - t:.1f} s")
    try:
        from client.api import Client

        memory, workers = state["memory"]["address"], [w["address"] for w in state["workers"]]
        with Client(memory, workers) as llm:
            info = llm.engine.model_info
            console.print(f"model {info.model_name} in [bold]{info.dtype}[/] (--dtype auto: the checkpoint's "
                          "bfloat16 where the CPU computes it natively, AVX-512 BF16 or AMX, else float32)")
            greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
            sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7, n=3, max_tokens=max_tokens)
            handles, names = [], {}
            t = time.perf_counter()
            monitor = Monitor(llm, names)
            monitor.start()
            for name, text in prompts:
                h = llm.submit([{"role": "user", "content": text}], sampled if name == SAMPLED else greedy)
                names[h.request_id] = name
                handles.append((name, h))
            from rich.progress import Progress

            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"generating {len(handles)} requests together", total=len(handles))
                while not all(h._done.is_set() for _, h in handles):
                    time.sleep(0.1)
                    bar.update(task, completed=sum(h._done.is_set() for _, h in handles))
            outs = [(name, h.result()) for name, h in handles]
            elapsed = time.perf_counter() - t
            monitor.stop.set()
            monitor.join()

            answers = Table(title="Answers", show_lines=True)
            for col in ("prompt", "n", "prompt tok", "out tok", "ttft s", "answer"):
                answers.add_column(col)
            total_out = 0
            for name, out in outs:
                for o in out.outputs:
                    total_out += len(o.token_ids)
                    answers.add_row(name, str(o.index), str(len(out.prompt_token_ids)), str(len(o.token_ids)),
                                    f"{out.metrics['ttft']:.2f}", escape(o.text.strip()))
            console.print(answers)
            steps = llm.engine.traces
            console.print(
                f"[bold]{total_out} output tokens in {elapsed:.1f} s = {total_out / elapsed:.1f} tokens/s[/] "
                f"over {len(steps)} steps, "
                f"mean batch {sum(len(s.request_ids) for s in steps) / max(1, len(steps)):.1f} "
                f"requests, peak {monitor.peak_used} blocks in use"
            )
            if monitor.best is not None:
                _, stats, seqs, labels = monitor.best
                console.print("Block allocation while the n=3 samples shared their prompt blocks:")
                console.print(stats_table(stats))
                console.print(sequences_table(seqs, labels))
            final = llm.stats()
        console.print(
            f"after the run: used blocks {final.used_blocks}, "
            f"available {final.available_blocks} of {final.total_blocks}"
        )
    finally:
        stopped = launcher.down()
        console.print(f"stopped {', '.join(stopped)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
