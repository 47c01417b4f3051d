"""The block index: which worker holds which prompt blocks, on which medium.

Layout (built for 64+ workers and millions of blocks):

* every (endpoint, dp_rank) gets a *slot*: one bit in a python-int bitmask (freed when the
  worker leaves the pool and reused by the next new one, so masks stay as wide as the
  live workers);
* one dict per medium (GPU, CPU, DISK): our block key → bitmask of the slots holding it
  (a single holder's mask is the slot's one shared bit object; equal multi-holder masks
  share one object too, up to a bounded cache, so masks cost ~no memory per block);
* one engine-key map per slot: engine block hash (`scorer.blocks.engine_key`) → our key, to
  map `BlockRemoved` and `parent_block_hash` back into our hash space (`slots.PyEngineMap`,
  a dict, or the compiled `scorer.native` EngineMap: a C table of uint64 pairs, insertion-
  ordered like the dict, ~half its memory);
* speculative entries (a request just routed there; its blocks are being computed) live in
  their own key → bitmask dict with a per-slot expiry, and count as GPU blocks.

`match` runs compiled when `scorer.native` is built (`gpu_depths`, `media_depths`): one C
pass reads each prompt key's GPU, speculative (and, when present, CPU/disk) masks as the
64-bit words of the candidates' slot mask, tracks the slots still holding every block so
far and stops at the first block none holds: ~one dict lookup per matched block, O(workers)
to list the depths. The Python path (the reference, `BlockIndex(native=False)`) looks every
prompt key up in the GPU dict with C-level iteration (`map(dict.get)`), finds where the
holder mask changes in C (`map(ne)` + `compress`) and runs Python code only per change (an
AND, and the workers that drop out there). The CPU and disk dicts are only read when one of
the prompt's keys is in them, and then only the positions with a CPU/disk copy get Python
work: O(blocks + non-GPU holders). A worker's count is its longest *contiguous* prefix: the
first missing block freezes it.

Modules (one job each): `block_index` (BlockIndex: updates, queries, introspection),
`slots` (worker slots and their bits), `masks` (holder bitmasks, shared mask objects,
prefix depths), `match` (the matching algorithms, `Match`), `speculative` (speculative
entries and their expiry), `bounds` (per-worker memory bound and eviction).
"""

from scorer.index.block_index import BlockIndex
from scorer.index.match import Match
from scorer.index.slots import MEDIA

__all__ = ["MEDIA", "BlockIndex", "Match"]
