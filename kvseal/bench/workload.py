"""A synthetic prefix-cache workload: multi-turn chats over shared system prompts, as block-hash prompts in arrival
order, for benchmarks that replay it against an engine (kvseal.bench.ops).

The model (every draw from one seeded generator, so a workload is the same on every run and machine):

- `system_prompts` system prompts, lengths log-normal around `system_tokens` (clipped to 64..8 x that); each
  conversation picks one with a Zipf(1.1) popularity, so a few prompts are shared by most conversations;
- `conversations` conversations start at uniform times over the run; each has 1 + Geometric(1/`mean_turns`)
  turns; a turn's user message is log-normal around 150 tokens, its assistant reply around 300 (both clipped);
  the turns of a conversation arrive an exponential think time apart (mean 1/8 of the run);
- request t of a conversation is its prompt at turn t: system prompt, every earlier user message and reply, the
  new user message. Its blocks are the full `block_tokens`-token blocks of that prompt, hashed as vLLM hashes
  them: a chain, each block's hash covering its parent's hash and its tokens (blake2b, 32 bytes).

So a request shares its system prompt's blocks with every conversation on that prompt, and its whole history
with the conversation's previous request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

VOCAB = 32000


@dataclass(frozen=True)
class Workload:
    seed: int = 0
    system_prompts: int = 8
    system_tokens: int = 2000
    conversations: int = 300
    mean_turns: float = 4.0
    max_turns: int = 12

    def requests(self, block_tokens: int) -> list[list[bytes]]:
        """Every request's block hashes, in arrival order."""
        rng = np.random.default_rng(self.seed)
        typical = self.system_tokens
        lengths = np.clip(rng.lognormal(np.log(typical), 0.6, self.system_prompts), 64, 8 * typical)
        systems = [rng.integers(0, VOCAB, int(n), dtype=np.int32) for n in lengths]
        popularity = 1.0 / np.arange(1, self.system_prompts + 1) ** 1.1
        popularity /= popularity.sum()
        arrivals: list[tuple[float, int, int]] = []  # (time, conversation, turn)
        turns: list[list[np.ndarray]] = []  # per conversation, the tokens each turn appends
        for c in range(self.conversations):
            n_turns = min(int(rng.geometric(1.0 / self.mean_turns)), self.max_turns)
            system = systems[int(rng.choice(self.system_prompts, p=popularity))]
            pieces = [system]
            t = float(rng.uniform(0.0, 1.0))
            for k in range(n_turns):
                if k:
                    reply = int(np.clip(rng.lognormal(np.log(300), 0.7), 20, 2000))
                    pieces.append(rng.integers(0, VOCAB, reply, dtype=np.int32))
                    t += float(rng.exponential(1 / 8))
                user = int(np.clip(rng.lognormal(np.log(150), 1.0), 5, 4000))
                pieces.append(rng.integers(0, VOCAB, user, dtype=np.int32))
                arrivals.append((t, c, k))
            turns.append(pieces)
        chains = [_Chain(block_tokens) for _ in range(self.conversations)]
        out = []
        for _, c, k in sorted(arrivals):
            # turn k's prompt: the system prompt, then user message / reply pairs, ending with user message k
            prompt = np.concatenate(turns[c][: 2 * k + 2])
            out.append(chains[c].hashes(prompt))
        return out


class _Chain:
    """A conversation's block hashes so far: each turn's prompt extends the previous one, so only the new full
    blocks are hashed."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.done: list[bytes] = []

    def hashes(self, prompt: np.ndarray) -> list[bytes]:
        bt = self.block_tokens
        parent = self.done[-1] if self.done else b"\0" * 32
        for i in range(len(self.done), len(prompt) // bt):
            parent = hashlib.blake2b(parent + prompt[i * bt : (i + 1) * bt].tobytes(), digest_size=32).digest()
            self.done.append(parent)
        return self.done[: len(prompt) // bt]
