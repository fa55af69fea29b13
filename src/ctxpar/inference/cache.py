"""A KV cache sharded over the ranks of a CP group: each rank keeps only its positions.

After prefill each rank holds the K/V (after RoPE) of the prompt positions its layout
gave it, T/P of them. Decoding then adds one position per step, and exactly one rank
keeps it: **position p goes to rank p mod P** (round-robin by position). Why this rule:

- every rank knows the owner of every position from the position alone, with no state
  and no message, so the ranks cannot disagree on it;
- every layout gives each rank exactly T/P prompt positions (T is a multiple of P), so
  after n decoded tokens the ranks hold T/P + floor(n/P) or one more: balanced within
  one token, which is what "the rank with the fewest" would give too, without its ties
  to break;
- under the striped layout decoding simply continues the prompt's own pattern.

Example, T = 8, P = 4, zigzag, 3 decoded tokens::

    rank 0: 0 7 | 8       rank 1: 1 6 | 9       rank 2: 2 5 | 10      rank 3: 3 4

Positions are stored next to the K/V, in the order they arrived (ascending within the
prompt and within decoding), so nothing downstream has to assume the rule above.

Memory: each rank allocates ceil(capacity / P) slots per layer up front, so a decode
step writes in place (no O(n) concatenation per token) and the cache of one rank is
1/P of the single-process cache plus at most one token per layer. K/V keep their H_kv
heads: nothing is repeated for GQA.
"""

from __future__ import annotations

import math
import weakref
import zlib

import torch
import torch.distributed as dist

from ctxpar import limits, topology


# Why a shard fills before the cache does: a prompt's positions stay where its layout put
# them, later ones are dealt round-robin, so a cache rewound into its prompt refills unevenly.
SHARD_FULL_WHY = ("positions after the prompt are dealt round-robin while the prompt's stay where its layout put "
                  "them, so a cache rewound into its prompt (rewind) refills one rank's shard first; build the cache "
                  "with room for the positions rewound once more (capacity + their number, rounded up to a multiple "
                  "of the ranks), or rewind no earlier than the prompt's end")


def decoded_owner(position: int, world_size: int) -> int:
    """The rank of P = ``world_size`` that keeps decoded position ``position``: round-robin."""
    return position % world_size


class KVCache:
    """This rank's share of a KV cache over a CP group.

    Args:
        layers: number of attention layers L.
        batch: sequences decoded together B (one prompt length for all).
        kv_heads: H_kv; K/V are stored with these heads only (GQA / MQA).
        head_dim: D.
        value_dim: V's head dim where it is not K's (multi-head latent attention caches K of
            its qk head dim, V of its v head dim); default D.
        capacity: the longest the sequence may grow, prompt plus generated tokens,
            counted over all ranks; each rank allocates ceil(capacity / P) slots.
        group: the CP process group (None: WORLD, or one process without one).
        dtype, device: of K and V (the model's).
        mesh: instead of ``group``, a hybrid 2D DeviceMesh whose ranks hold the cache, each
            at its place in the CP layout (``ctxpar.hybrid_rank``): ``model.generate()``'s
            under a hybrid strategy. ctxpar's prefill, decode_step and partial_prefill take
            a cache on a group (hybrid prefill takes its mesh= besides).

    Attributes:
        seq_len: positions in the sequence so far (every rank alike).
        prompt_len: the prefilled prompt's length T (0 before prefill).
        length: positions this rank holds.
        dealt_by: how prefill dealt the prompt's positions to the ranks (its layout's
            fingerprint, and a hybrid mesh's places); "" before prefill.
    """

    def __init__(self, *, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", value_dim: int | None = None, mesh=None) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        counts = dict(layers=layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                      capacity=capacity)
        for name, value in counts.items():
            counts[name] = limits.whole(value)  # numpy integers too, as generate takes them
            if counts[name] is None or not 1 <= counts[name] <= limits.MAX_COUNT:
                raise ValueError(f"KVCache {name} must be an int between 1 and {limits.MAX_COUNT}, got {value!r}")
        layers, batch, kv_heads, head_dim, value_dim, capacity = counts.values()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"KVCache dtype must be a floating-point torch.dtype (the model's, e.g. torch.bfloat16), "
                             f"got {dtype!r}")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"KVCache device must be a torch.device or its name ('cpu', 'cuda:0'), got {device!r}: "
                             f"{e}") from None
        if device.type == "cuda" and not (device.index or 0) < torch.cuda.device_count():
            # torch's own refusal was an AssertionError, or an allocation failure that advised a smaller capacity
            raise ValueError(f"KVCache device {device}: this process sees {torch.cuda.device_count()} CUDA device(s); "
                             f"build the cache on the model's device")
        topo = topology.of(group, mesh, "KVCache")
        self.group, self.mesh, self.rank, self.world_size = group, mesh, topo.rank, topo.world_size
        self.layers, self.batch, self.kv_heads, self.head_dim = layers, batch, kv_heads, head_dim
        self.value_dim = value_dim
        self.capacity = capacity
        self.local_capacity = -(-capacity // self.world_size)
        # (L, B, H_kv, slots, D) and (L, B, H_kv, slots, Dv); slots past ``length`` are never read
        shape = (layers, batch, kv_heads, self.local_capacity)
        try:
            self._keys = torch.empty((*shape, head_dim), dtype=dtype, device=device)
            self._values = torch.empty((*shape, value_dim), dtype=dtype, device=device)
        except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) is one too
            need = math.prod(shape) * (head_dim + value_dim) * dtype.itemsize
            why = next(iter(str(e).splitlines()), type(e).__name__)  # the first line of a message, if any
            raise ValueError(f"rank {self.rank}'s KVCache shard, {self.local_capacity} of its {capacity} positions "
                             f"(x {layers} layers, batch {batch}, {kv_heads} K/V heads), needs {need / 2**30:.3g} "
                             f"GiB on {device}, which could not be allocated ({why}); build it "
                             f"with a smaller capacity or batch, or over more ranks") from None
        self._positions = torch.full((self.local_capacity,), -1, dtype=torch.int64)
        self.seq_len = self.prompt_len = self.length = 0
        self.dealt_by = ""
        self.filled_by: weakref.ref | None = None  # the model whose K/V it holds (``hooks.check_model_fits``)
        self._tokens: torch.Tensor | None = None  # (B, capacity) int64, made by the first commit with tokens
        self._history = (0, 0)  # (n, crc32 of the first n positions' tokens): ``history``, extended lazily

    @classmethod
    def for_model(cls, cfg, *, batch: int, capacity: int, group: dist.ProcessGroup | None = None,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> KVCache:
        """A cache shaped for a ``ctxpar.models.ModelConfig``."""
        if not all(hasattr(cfg, name) for name in ("layers", "kv_heads", "head_dim")):
            raise ValueError(f"KVCache.for_model takes a ctxpar.models.ModelConfig (model.cfg), got "
                             f"{type(cfg).__name__}")
        return cls(layers=cfg.layers, batch=batch, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, capacity=capacity,
                   group=group, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self._keys.dtype

    @property
    def device(self) -> torch.device:
        return self._keys.device

    @property
    def made_in_inference_mode(self) -> bool:
        """Whether its tensors are inference tensors (built under ``torch.inference_mode()``),
        which only calls inside inference mode may write."""
        return self._keys.is_inference()

    @property
    def element_size(self) -> int:
        """Bytes per K/V element."""
        return self._keys.element_size()

    def owner(self, position: int) -> int:
        """The rank that keeps a decoded position's K/V: round-robin, ``position mod P``."""
        return decoded_owner(position, self.world_size)

    def next_positions(self, new: int, rank: int) -> torch.Tensor:
        """(int64) the positions among the next ``new`` after the ``seq_len`` held that ``rank``
        keeps (``owner``: p mod P), ascending."""
        count, index = limits.whole(new), limits.whole(rank)  # Python ints (numpy's taken), None if not integers
        if count is None or count < 0:
            raise ValueError(f"next_positions: new must be a count of positions >= 0, got {new!r}")
        if index is None or not 0 <= index < self.world_size:
            raise ValueError(f"next_positions: rank must be one of 0..{self.world_size - 1}, got {rank!r}")
        first = self.seq_len + (index - self.seq_len) % self.world_size
        return torch.tensor(range(first, self.seq_len + count, self.world_size), dtype=torch.int64)

    def keys(self, layer: int, length: int | None = None) -> torch.Tensor:
        """(B, H_kv, n, D) view of this rank's keys of ``layer`` (n = ``length``, default all held)."""
        return self._keys[layer, :, :, : self.length if length is None else length]

    def values(self, layer: int, length: int | None = None) -> torch.Tensor:
        """(B, H_kv, n, Dv) view of this rank's values of ``layer``, like ``keys``."""
        return self._values[layer, :, :, : self.length if length is None else length]

    def positions(self) -> torch.Tensor:
        """(n,) int64: the global positions this rank holds, in slot order."""
        return self._positions[: self.length].clone()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k (B, H_kv, n, D) and v (B, H_kv, n, Dv) of ``layer`` in slots
        start..start+n-1; they count as held only once ``commit`` says so (a forward that
        fails half-way leaves no trace)."""
        n = k.shape[2]
        if k.shape != (self.batch, self.kv_heads, n, self.head_dim) or v.shape != (*k.shape[:3], self.value_dim):
            dims = f"D = {self.head_dim}" + (f", Dv = {self.value_dim}" if self.value_dim != self.head_dim else "")
            raise ValueError(f"layer {layer}: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache's "
                             f"(B, H_kv, n, D) = ({self.batch}, {self.kv_heads}, n, D), {dims}")
        if start + n > self.local_capacity:
            raise ValueError(f"{start + n} positions on rank {self.rank} exceed its {self.local_capacity} slots")
        self._keys[layer, :, :, start: start + n] = k
        self._values[layer, :, :, start: start + n] = v

    def commit(self, positions: torch.Tensor, *, seq_len: int, tokens: torch.Tensor | None = None) -> None:
        """Count the slots ``length``.. as holding ``positions`` (written to every layer),
        and the sequence as ``seq_len`` long; ``tokens``, the (B, n) token ids of its last n
        positions (ctxpar's prefill, decode_step and partial_prefill pass them), for ``history``."""
        if tokens is not None:
            if self._tokens is None:  # made as the K/V were, inference tensors or not: a call in the other mode
                # made it otherwise, and torch refused every later write outside inference mode
                with torch.inference_mode(self.made_in_inference_mode):
                    self._tokens = torch.zeros((self.batch, self.capacity), dtype=torch.int64, device=self.device)
            self._tokens[:, seq_len - tokens.shape[1]: seq_len] = tokens
        n = positions.numel()
        self._positions[self.length: self.length + n] = positions.cpu()
        self.length += n
        self.seq_len = seq_len
        if self.prompt_len == 0:
            self.prompt_len = seq_len

    @property
    def history(self) -> int:
        """crc32 of the token ids fed so far, position after position: alike on ranks holding one
        sequence, which ``decode_step`` and ``partial_prefill`` compare before extending it (two
        caches taken in another order on one rank once gave every rank plausible logits of
        neither sequence). Reads only the positions fed since it was last read."""
        done, code = self._history
        if done < self.seq_len and self._tokens is not None:
            fed = self._tokens[:, done: self.seq_len].t().contiguous().cpu()  # position-major: any split, one code
            code = zlib.crc32(fed.numpy().tobytes(), code)
            self._history = (self.seq_len, code)
        return code

    def rewind(self, seq_len: int) -> None:
        """Forget the positions from ``seq_len`` on (a turn taken back, or the same chunk
        timed again): every rank alike, no communication; the next call continues there."""
        length = limits.whole(seq_len)  # a Python int (numpy's taken), None if not an integer
        if length is None or not 0 <= length <= self.seq_len:
            raise ValueError(f"rewind to {seq_len!r}: a length between 0 and the {self.seq_len} positions held "
                             f"(an integer)")
        keep = int((self._positions[: self.length] < length).sum())  # positions ascend in slot order
        self._positions[keep:] = -1
        self.length, self.seq_len = keep, length
        self.prompt_len = min(self.prompt_len, seq_len)
        if seq_len < self._history[0]:
            self._history = (0, 0)
        if seq_len == 0:
            self.dealt_by = ""

    def reset(self) -> None:
        """Forget everything held (the memory stays allocated for the next prompt)."""
        self._positions.fill_(-1)
        self.seq_len = self.prompt_len = self.length = 0
        self.dealt_by, self._history = "", (0, 0)

    @property
    def bytes_per_position(self) -> int:
        """K and V of one position over all layers."""
        return self.layers * self.batch * self.kv_heads * (self.head_dim + self.value_dim) * self.element_size

    @property
    def nbytes(self) -> int:
        """Bytes this rank allocated for K/V: ceil(capacity / P) positions."""
        return self.local_capacity * self.bytes_per_position

    @property
    def held_bytes(self) -> int:
        """Bytes of K/V this rank holds now."""
        return self.length * self.bytes_per_position
