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

`ChatTrace` is a chat service's hour calibrated to a public production trace's figures: one-shot API calls and
chats that go on, think times, sessions that end, shared system prompts.

`MixedWorkload` interleaves four kinds of traffic over one run, for the eviction policies' hit-ratio simulator
(kvseal.bench.hitrate): such chats (a `Workload` of their own), agent loops that re-send a growing context, RAG
prompts over a shared pool of documents, and one-off prompts that are never seen again.
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
        return [request for _, request in self.timed(block_tokens)]

    def timed(self, block_tokens: int) -> list[tuple[float, list[bytes]]]:
        """Every request's arrival time (in run lengths, from 0) and block hashes, in arrival order."""
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
        for t, c, k in sorted(arrivals):
            # turn k's prompt: the system prompt, then user message / reply pairs, ending with user message k
            prompt = np.concatenate(turns[c][: 2 * k + 2])
            out.append((t, chains[c].hashes(prompt)))
        return out


@dataclass(frozen=True)
class MixedWorkload:
    """Chats, agent loops, RAG and one-off prompts, interleaved by arrival time (every draw seeded: the same
    workload on every run and machine). Arrival times are uniform over the run unless said otherwise:

    - `chat`: multi-turn chats over shared system prompts, as `Workload` (its own seed and times);
    - `agents` agent loops, each on one of `agent_prompts` system prompts (Zipf(1.1), ~1500 tokens) with a task
      message (~300 tokens), running 5..30 steps (`min_steps`..`max_steps`, uniform) an exponential
      `agent_gap` apart; each step re-sends the whole context and appends a model output (log-normal ~100
      tokens) and a tool result (log-normal ~300 tokens);
    - `rag` requests: one of `rag_prompts` system prompts (~600 tokens, uniform), then 1..3 distinct documents of a
      pool of `documents` (log-normal ~600 tokens, Zipf(1.0) popularity, in drawn order), then a unique question
      (~60 tokens);
    - `one_offs` prompts of unique tokens from the first one (log-normal ~1000 tokens), never repeated.

    `requests(block_tokens)`: every request's block hashes, chained as `Workload`'s, in arrival order;
    `labelled(block_tokens)` also names each request's kind. The defaults give 3378 requests asking 892k blocks
    of which 171k distinct at 16-token blocks (26k and 5.1k at 512), in about a second."""

    seed: int = 0
    chat: Workload = Workload(seed=1)
    agents: int = 60
    agent_prompts: int = 4
    min_steps: int = 5
    max_steps: int = 30
    agent_gap: float = 0.003
    rag: int = 1000
    rag_prompts: int = 2
    documents: int = 200
    one_offs: int = 400

    KINDS = ("chat", "agent", "rag", "one-off")

    def requests(self, block_tokens: int) -> list[list[bytes]]:
        """Every request's block hashes, in arrival order."""
        return [hashes for _, hashes in self.labelled(block_tokens)]

    def labelled(self, block_tokens: int) -> list[tuple[str, list[bytes]]]:
        """Every request's kind (one of KINDS) and block hashes, in arrival order."""
        rng = np.random.default_rng(self.seed)
        timed: list[tuple[float, int, int, list[bytes]]] = [  # (time, kind, sequence number, hashes)
            (t, 0, i, hashes) for i, (t, hashes) in enumerate(self.chat.timed(block_tokens))
        ]

        def tokens(typical: float, sigma: float, low: int, high: int) -> np.ndarray:
            n = int(np.clip(rng.lognormal(np.log(typical), sigma), low, high))
            return rng.integers(0, VOCAB, n, dtype=np.int32)

        def zipf(n: int, s: float) -> np.ndarray:
            p: np.ndarray = 1.0 / np.arange(1, n + 1) ** s
            p /= p.sum()
            return p

        agent_systems = [tokens(1500, 0.4, 200, 6000) for _ in range(self.agent_prompts)]
        agent_popularity = zipf(self.agent_prompts, 1.1)
        for a in range(self.agents):
            pieces = [
                agent_systems[int(rng.choice(self.agent_prompts, p=agent_popularity))],
                tokens(300, 0.7, 20, 3000),
            ]
            chain = _Chain(block_tokens)
            t = float(rng.uniform(0.0, 1.0))
            for _ in range(int(rng.integers(self.min_steps, self.max_steps + 1))):
                timed.append((t, 1, a, chain.hashes(np.concatenate(pieces))))
                pieces += [tokens(100, 0.8, 5, 2000), tokens(300, 1.0, 10, 8000)]
                t += float(rng.exponential(self.agent_gap))

        rag_systems = [tokens(600, 0.3, 100, 3000) for _ in range(self.rag_prompts)]
        docs = [tokens(600, 0.7, 100, 6000) for _ in range(self.documents)]
        doc_popularity = zipf(self.documents, 1.0)
        for r in range(self.rag):
            system = rag_systems[int(rng.integers(self.rag_prompts))]
            chosen = rng.choice(self.documents, int(rng.integers(1, 4)), replace=False, p=doc_popularity)
            prompt = np.concatenate([system, *(docs[int(d)] for d in chosen), tokens(60, 0.5, 5, 500)])
            timed.append((float(rng.uniform(0.0, 1.0)), 2, r, _Chain(block_tokens).hashes(prompt)))

        for o in range(self.one_offs):
            prompt = tokens(1000, 0.8, 32, 16000)
            timed.append((float(rng.uniform(0.0, 1.0)), 3, o, _Chain(block_tokens).hashes(prompt)))
        timed.sort(key=lambda x: x[:3])
        return [(self.KINDS[kind], hashes) for _, kind, _, hashes in timed]


@dataclass(frozen=True)
class ChatTrace:
    """A chat service's hour as a production trace shows it (calibrated to the figures of a public one: about 12 k
    requests, 24 blocks of 512 tokens a request on average, 183 k distinct blocks, 63 % of them never asked again,
    an infinite cache hitting 0.37 of the blocks asked, prefix-LRU at 5 % of the distinct blocks 0.196, Belady
    with admission 1.87 x that). Every draw is seeded. At 512-token blocks the defaults give 12.6 k requests, 24.8
    blocks a request, 189 k distinct, 62 % never asked again, 0.398 for an infinite cache, 0.210 for prefix-LRU at
    5 % and 1.89 x that for Belady with admission.

    - `sessions` sessions start at uniform times over `hour` seconds; an `api` share of them are one-shot API calls
      (one request, a long unique prompt, log-normal around `api_tokens`), the others chats;
    - a chat has one turn with probability `one_turn`, else 1 + Geometric(1 / `mean_more`) turns (at most
      `max_turns`); its first message is log-normal around `chat_tokens`; each later turn appends the previous
      answer (log-normal ~350 tokens) and a new question (log-normal ~120 tokens, heavy-tailed) an exponential
      `think` seconds after the previous turn; turns after the hour are not sent (sessions that end unseen);
    - a `shared` share of sessions open with one of `system_prompts` system prompts (Zipf(1.0), log-normal around
      `system_tokens`), the others with a prompt of their own of that size.

    Request t of a session is its whole conversation so far, hashed as `Workload` hashes it. Long one-shot prompts
    and chats that go on are the two kinds of traffic a cache must tell apart: their first requests look alike to
    recency, not to a policy that learns what a request's shape says of its reuse."""

    seed: int = 0
    sessions: int = 6400
    hour: float = 3600.0
    api: float = 0.3
    api_tokens: int = 11000
    chat_tokens: int = 3500
    one_turn: float = 0.15
    mean_more: float = 1.8
    max_turns: int = 40
    think: float = 170.0
    shared: float = 0.1
    system_prompts: int = 40
    system_tokens: int = 1000

    def requests(self, block_tokens: int) -> list[list[bytes]]:
        """Every request's block hashes, in arrival order."""
        rng = np.random.default_rng(self.seed)

        def tokens(typical: float, sigma: float, low: int, high: int) -> np.ndarray:
            n = int(np.clip(rng.lognormal(np.log(typical), sigma), low, high))
            return rng.integers(0, VOCAB, n, dtype=np.int32)

        systems = [tokens(self.system_tokens, 0.9, 64, 40000) for _ in range(self.system_prompts)]
        popularity = 1.0 / np.arange(1, self.system_prompts + 1)
        popularity /= popularity.sum()
        arrivals: list[tuple[float, int, int]] = []  # (time, session, turn)
        pieces: list[list[np.ndarray]] = []  # per session: its opening, then first message, answer, question, ...
        for s in range(self.sessions):
            api = rng.random() < self.api
            if api or rng.random() < self.one_turn:
                turns = 1
            else:
                turns = min(1 + int(rng.geometric(1 / self.mean_more)), self.max_turns)
            if rng.random() < self.shared:
                opening = systems[int(rng.choice(self.system_prompts, p=popularity))]
            else:
                opening = tokens(self.system_tokens, 0.9, 16, 40000)
            mine = [opening, tokens(self.api_tokens if api else self.chat_tokens, 1.4, 3, 120000)]
            t = float(rng.uniform(0.0, self.hour))
            arrivals.append((t, s, 0))
            for k in range(1, turns):
                mine += [tokens(350, 0.8, 10, 4000), tokens(120, 1.2, 3, 30000)]
                t += float(rng.exponential(self.think))
                if t <= self.hour:
                    arrivals.append((t, s, k))
            pieces.append(mine)
        chains: dict[int, _Chain] = {}
        out = []
        for _, s, k in sorted(arrivals):
            chain = chains.setdefault(s, _Chain(block_tokens))
            out.append(chain.hashes(np.concatenate(pieces[s][: 2 + 2 * k])))
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
