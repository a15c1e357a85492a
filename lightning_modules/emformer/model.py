"""EMFormer: an hourglass transformer over weather-state patches with a multi-scale-convolution middle stack.

Importing this module registers ``emformer_tiny``, ``emformer_small`` and ``emformer_base`` with timm, so
``timm.create_model("emformer_tiny", in_chans=12, img_size=(32, 64))`` works (the timm convention: a model
module registers its architectures when imported).

Shape walk (``x [B, C, H, W]`` -> ``[B, C, H, W]``, the next state):

1. timm ``PatchEmbed`` (``patch_size`` x ``patch_size``, stride = patch) -> tokens on an ``h x w`` grid plus a
   learnable absolute position embedding;
2. per hourglass level: ``pre`` transformer layers, a **down** step (pairs of neighbouring tokens along the
   longer grid axis concatenated and projected, then an attention-resampling layer in which each pooled
   token attends to its two sources), the next level, an **up** step (a linear layer splits each token into two,
   the level's residual is added, and the pair attends to its valley token and itself), ``post`` layers;
3. the middle stack alternates **window attention** (even layers; windows cycle through ``windows``) and
   **global multi-conv attention** (odd layers); in both the q/k/v map goes through the merged multi-scale
   convolution (:class:`~lightning_modules.emformer.conv.MultiScaleConv2d`) before attention. The alternation
   starts at ``alternate_min_depth`` (the released code alternates only for middle depths above 10; tiny
   models set 0 so both kinds run);
4. LayerNorm, a linear head to ``C * p * p`` and un-patchify; with ``residual=True`` the head predicts the
   increment over the input state.

All attention runs through :func:`litctx_kernels.attention` (non-causal).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from einops import rearrange
from timm.models import register_model
from torch import nn

import litctx_kernels
from lightning_modules.emformer.conv import MultiScaleConv2d

__all__ = ["EMFormer", "MultiConvAttention", "HourglassLevel", "VARIANTS", "architecture_args", "grid_problem",
           "used_windows", "emformer_tiny", "emformer_small", "emformer_base"]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal attention ``[B, h, Nq, d]`` over ``[B, h, Nk, d]``."""
    return litctx_kernels.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=False)[0]


class SelfAttention(nn.Module):
    """Global multi-head self-attention on tokens ``[B, N, D]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"embed_dim={dim} must be divisible by num_heads={heads}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b n (t h d) -> t b h n d", t=3, h=self.heads)
        return self.proj(rearrange(_attend(q, k, v), "b h n d -> b n (h d)"))


class MultiConvAttention(nn.Module):
    """q/k/v from a linear layer, mixed spatially by the merged multi-scale convolution on the token grid,
    then attention globally (``window=None``) or inside non-overlapping ``(wh, ww)`` windows.

    Shapes: ``x [B, h*w, D]`` with ``grid = (h, w)`` -> ``[B, h*w, D]``."""

    def __init__(self, dim: int, heads: int, grid: Tuple[int, int], window: Optional[Tuple[int, int]] = None,
                 conv_groups: str = "depthwise", merged: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"embed_dim={dim} must be divisible by num_heads={heads}")
        if window is not None and (grid[0] % window[0] or grid[1] % window[1]):
            raise ValueError(f"window {window} does not tile the {grid[0]}x{grid[1]} token grid")
        self.heads, self.grid, self.window = heads, grid, window
        self.qkv = nn.Linear(dim, 3 * dim)
        groups = 3 * dim if conv_groups == "depthwise" else 1
        self.conv = MultiScaleConv2d(3 * dim, 3 * dim, (1, 3, 5), groups=groups, merged=merged)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = self.grid
        qkv = rearrange(self.qkv(x), "b (h w) c -> b c h w", h=h, w=w)
        qkv = self.conv(qkv.float()).to(x.dtype)  # the released code runs this conv in fp32
        if self.window is None:
            q, k, v = rearrange(qkv, "b (t n d) h w -> t b n (h w) d", t=3, n=self.heads)
            out = rearrange(_attend(q, k, v), "b n (h w) d -> b (h w) (n d)", h=h, w=w)
        else:
            wh, ww = self.window
            q, k, v = rearrange(qkv, "b (t n d) (y wh) (z ww) -> t (b y z) n (wh ww) d", t=3, n=self.heads,
                                wh=wh, ww=ww)
            # (y wh z ww) flattens row-major over (h, w) = (y*wh + i, z*ww + j): the original token order
            out = rearrange(_attend(q, k, v), "(b y z) n (wh ww) d -> b (y wh z ww) (n d)", y=h // wh, z=w // ww,
                            wh=wh, ww=ww)
        return self.proj(out)


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (timm ``Mlp``, GELU)."""

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4.0, drop_path: float = 0.0) -> None:
        super().__init__()
        from timm.layers import DropPath, Mlp

        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def _halve(grid: Tuple[int, int]) -> Tuple[Tuple[int, int], int]:
    """The grid after pairing neighbours along its longer axis, and that axis (0 = rows, 1 = columns)."""
    h, w = grid
    axis = 1 if w >= h else 0
    if (w if axis else h) % 2:
        raise ValueError(f"token grid {h}x{w} cannot be halved along its longer axis (odd length)")
    return ((h, w // 2) if axis else (h // 2, w)), axis


def _pairs(x: torch.Tensor, grid: Tuple[int, int], axis: int) -> torch.Tensor:
    """``[B, h*w, D]`` -> ``[B, h*w/2, 2, D]``: neighbouring token pairs along ``axis``."""
    h, w = grid
    if axis == 1:
        return rearrange(x, "b (h w two) d -> b (h w) two d", h=h, w=w // 2, two=2)
    return rearrange(x, "b (h two w) d -> b (h w) two d", h=h // 2, two=2, w=w)


def _unpairs(x: torch.Tensor, grid: Tuple[int, int], axis: int) -> torch.Tensor:
    """Inverse of :func:`_pairs`."""
    h, w = grid
    if axis == 1:
        return rearrange(x, "b (h w) two d -> b (h w two) d", h=h, w=w // 2, two=2)
    return rearrange(x, "b (h w) two d -> b (h two w) d", h=h // 2, two=2, w=w)


class Resample(nn.Module):
    """Attention resampling: each query token attends to a small set of key tokens (its own group).

    ``q [G, Nq, D]`` over ``kv [G, Nk, D]`` -> ``[G, Nq, D]`` (G = batch x groups)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_kv = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        qh = rearrange(self.q(self.norm_q(q)), "g n (h d) -> g h n d", h=self.heads)
        k, v = rearrange(self.kv(self.norm_kv(kv)), "g n (t h d) -> t g h n d", t=2, h=self.heads)
        return q + self.proj(rearrange(_attend(qh, k, v), "g h n d -> g n (h d)"))


class HourglassLevel(nn.Module):
    """``pre`` layers, down (linear + attention resampling), the inner module, up, ``post`` layers."""

    def __init__(self, dim: int, heads: int, grid: Tuple[int, int], pre: int, post: int, inner: nn.Module,
                 mlp_ratio: float, drop_path: float) -> None:
        super().__init__()
        self.grid = grid
        self.inner_grid, self.axis = _halve(grid)
        self.pre = nn.ModuleList([Block(dim, SelfAttention(dim, heads), mlp_ratio, drop_path) for _ in range(pre)])
        self.down = nn.Linear(2 * dim, dim)
        self.down_attn = Resample(dim, heads)
        self.inner = inner
        self.up = nn.Linear(dim, 2 * dim)
        self.up_attn = Resample(dim, heads)
        self.post = nn.ModuleList([Block(dim, SelfAttention(dim, heads), mlp_ratio, drop_path) for _ in range(post)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.pre:
            x = blk(x)
        b, _, d = x.shape
        pairs = _pairs(x, self.grid, self.axis)  # [B, M, 2, D]
        pooled = self.down(rearrange(pairs, "b m two d -> b m (two d)"))
        pooled = self.down_attn(rearrange(pooled, "b m d -> (b m) 1 d"), rearrange(pairs, "b m two d -> (b m) two d"))
        valley = self.inner(rearrange(pooled, "(b m) 1 d -> b m d", b=b))
        up = rearrange(self.up(valley), "b m (two d) -> b m two d", two=2) + pairs
        keys = torch.cat([valley.unsqueeze(2), up], dim=2)  # the pair attends to its valley token and itself
        up = self.up_attn(rearrange(up, "b m two d -> (b m) two d"), rearrange(keys, "b m k d -> (b m) k d"))
        x = _unpairs(rearrange(up, "(b m) two d -> b m two d", b=b), self.grid, self.axis)
        for blk in self.post:
            x = blk(x)
        return self.norm(x)


class MiddleStack(nn.Module):
    """Alternating window / global multi-conv attention layers on the valley grid."""

    def __init__(self, dim: int, heads: int, grid: Tuple[int, int], depth: int, windows: Sequence[Sequence[int]],
                 alternate_min_depth: int, mlp_ratio: float, drop_path: float, conv_groups: str, merged: bool) -> None:
        super().__init__()
        alternate = depth > alternate_min_depth
        layers = []
        for i in range(depth):
            if alternate and i % 2 == 0:
                window = tuple(windows[(i // 2) % len(windows)])
                attn = MultiConvAttention(dim, heads, grid, window, conv_groups, merged)
            else:
                attn = MultiConvAttention(dim, heads, grid, None, conv_groups, merged)
            layers.append(Block(dim, attn, mlp_ratio, drop_path))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.layers:
            x = blk(x)
        return x


class EMFormer(nn.Module):
    """EMFormer (see the module docstring).

    Args:
        img_size: ``(H, W)`` of the state; in_chans: channels C.
        patch_size: patch side (tokens on an ``H/p x W/p`` grid).
        embed_dim, num_heads, mlp_ratio, drop_path_rate: transformer sizes.
        levels: ``[(pre, post), ...]`` layers per hourglass level, outermost first (each level halves the
            token count).
        mid_depth: layers of the middle stack.
        windows: window sizes cycled by the middle stack's window layers.
        alternate_min_depth: alternate window/global layers only when ``mid_depth`` exceeds this (code: 10).
        conv_groups: ``depthwise`` (default here) or ``dense`` (the released code) multi-scale convolution.
        merged_conv: one merged convolution (True) or three separate ones summed (False, same numbers).
        residual: predict the increment over the input state.
        num_classes: accepted for timm's interface; unused (the head predicts the state).

    An unknown keyword is a ``TypeError`` (no ``**kwargs`` sink); the keywords timm hands every entrypoint
    (``pretrained_cfg``, ``pretrained_cfg_overlay``, ``cache_dir``) are dropped by name in the entrypoints. The
    grid must satisfy :func:`grid_problem` (``EMFormerModule``'s ``grid_fit`` pads or crops data grids to one).
    """

    def __init__(self, img_size: Sequence[int] = (32, 64), in_chans: int = 12, patch_size: int = 2,
                 embed_dim: int = 64, num_heads: int = 4, mlp_ratio: float = 4.0, drop_path_rate: float = 0.0,
                 levels: Sequence[Sequence[int]] = ((1, 1), (1, 1)), mid_depth: int = 4,
                 windows: Sequence[Sequence[int]] = ((4, 4), (8, 2), (2, 8)), alternate_min_depth: int = 0,
                 conv_groups: str = "depthwise", merged_conv: bool = True, residual: bool = True,
                 num_classes: int = 0) -> None:
        super().__init__()
        from timm.layers import PatchEmbed, trunc_normal_

        if conv_groups not in ("depthwise", "dense"):
            raise ValueError(f"conv_groups must be 'depthwise' or 'dense', got {conv_groups!r}")
        h, w = int(img_size[0]), int(img_size[1])
        problem = grid_problem((h, w), patch_size, levels, windows, mid_depth, alternate_min_depth)
        if problem:
            raise ValueError(problem)
        self.img_size, self.in_chans, self.patch_size, self.residual = (h, w), in_chans, patch_size, residual
        self.patch_embed = PatchEmbed(img_size=(h, w), patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        grid = (h // patch_size, w // patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid[0] * grid[1], embed_dim))
        trunc_normal_(self.pos_embed, std=0.02)
        grids: List[Tuple[int, int]] = [grid]
        for _ in levels:
            grids.append(_halve(grids[-1])[0])
        inner: nn.Module = MiddleStack(embed_dim, num_heads, grids[-1], mid_depth, windows, alternate_min_depth,
                                       mlp_ratio, drop_path_rate, conv_groups, merged_conv)
        for (pre, post), g in zip(reversed(list(levels)), reversed(grids[:-1])):
            inner = HourglassLevel(embed_dim, num_heads, g, int(pre), int(post), inner, mlp_ratio, drop_path_rate)
        self.body = inner
        self.grids = grids
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, in_chans * patch_size ** 2)
        self.apply(self._init)
        if residual:  # start as persistence: the increment head begins at zero
            nn.init.zeros_(self.head.weight)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            from timm.layers import trunc_normal_

            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != (self.in_chans, *self.img_size):
            raise ValueError(f"expected [B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}], got {list(x.shape)}")
        tokens = self.patch_embed(x) + self.pos_embed
        tokens = self.norm(self.body(tokens))
        p = self.patch_size
        gh, gw = self.grids[0]
        out = rearrange(self.head(tokens), "b (h w) (c p q) -> b c (h p) (w q)", h=gh, w=gw, p=p, q=p)
        return x + out if self.residual else out


def used_windows(windows: Sequence[Sequence[int]], mid_depth: int,
                 alternate_min_depth: int) -> List[Tuple[int, int]]:
    """The window sizes the middle stack's window layers actually use (none without alternation)."""
    if mid_depth <= alternate_min_depth:
        return []
    return [tuple(int(v) for v in windows[(i // 2) % len(windows)]) for i in range(0, mid_depth, 2)]


def grid_problem(img_size: Sequence[int], patch_size: int, levels: Sequence[Sequence[int]],
                 windows: Sequence[Sequence[int]], mid_depth: int, alternate_min_depth: int) -> Optional[str]:
    """Why an ``(H, W)`` grid does not fit the architecture (None when it does): ``H`` and ``W`` must be
    multiples of ``patch_size``, each hourglass level halves the token grid along its longer axis (that length
    must be even), and every window the middle stack uses must tile the innermost token grid."""
    h, w = int(img_size[0]), int(img_size[1])
    if h < patch_size or w < patch_size or h % patch_size or w % patch_size:
        return f"img_size {h}x{w} is not a multiple of patch_size={patch_size}"
    grid = (h // patch_size, w // patch_size)
    for _ in levels:
        g0, g1 = grid
        if (g1 if g1 >= g0 else g0) % 2 or min(grid) < 1:
            return (f"img_size {h}x{w}: token grid {g0}x{g1} cannot be halved along its longer axis (odd length) "
                    f"for {len(levels)} hourglass level(s)")
        grid = _halve(grid)[0]
    for window in used_windows(windows, mid_depth, alternate_min_depth):
        if grid[0] % window[0] or grid[1] % window[1]:
            return f"img_size {h}x{w}: window {window} does not tile the {grid[0]}x{grid[1]} middle token grid"
    return None


# the timm variants' settings over EMFormer's defaults
VARIANTS = {
    "emformer_tiny": dict(embed_dim=64, num_heads=4, levels=((1, 1), (1, 1)), mid_depth=4, alternate_min_depth=0),
    "emformer_small": dict(embed_dim=256, num_heads=8, levels=((2, 2), (2, 2), (2, 2)), mid_depth=8,
                           alternate_min_depth=0),
    "emformer_base": dict(img_size=(128, 256), in_chans=70, embed_dim=768, num_heads=8,
                          levels=((2, 2), (2, 2), (2, 2), (2, 2)), mid_depth=24, windows=((8, 8), (16, 4), (4, 16)),
                          alternate_min_depth=10, conv_groups="dense", residual=False),
}

# what timm.create_model hands every entrypoint besides the user's arguments (no use offline; dropped by name)
_TIMM_KWARGS = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")


def architecture_args(variant: str, **overrides: object) -> dict:
    """EMFormer's constructor arguments for a registered ``variant`` with ``overrides``: every argument, the
    constructor's defaults under the variant's settings under the overrides."""
    import inspect

    if variant not in VARIANTS:
        raise ValueError(f"unknown EMFormer variant {variant!r}; registered: {', '.join(VARIANTS)}")
    sig = inspect.signature(EMFormer.__init__).parameters
    defaults = {k: p.default for k, p in sig.items() if k != "self"}
    return {**defaults, **VARIANTS[variant], **overrides}


def _create(variant: str, pretrained: bool = False, **kwargs):
    if pretrained:
        raise ValueError(f"{variant}: no pretrained weights are published offline; pass pretrained=False")
    for key in _TIMM_KWARGS:
        kwargs.pop(key, None)
    return EMFormer(**{**VARIANTS[variant], **kwargs})


@register_model
def emformer_tiny(pretrained: bool = False, **kwargs) -> EMFormer:
    """CPU-scale: 32x64 grid, patch 2, embed 64, 4 heads, two levels (512 -> 256 -> 128 tokens), 4 middle
    layers alternating window/global multi-conv attention, depthwise multi-scale convolution."""
    return _create("emformer_tiny", pretrained, **kwargs)


@register_model
def emformer_small(pretrained: bool = False, **kwargs) -> EMFormer:
    """embed 256, 8 heads, three levels, 8 middle layers."""
    return _create("emformer_small", pretrained, **kwargs)


@register_model
def emformer_base(pretrained: bool = False, **kwargs) -> EMFormer:
    """The released configuration: 128x256 input, 70 channels, embed 768, 8 heads, depth spec
    (2, (2, (2, (2, 24, 2), 2), 2), 2), dense multi-scale convolution, windows (8,8), (16,4), (4,16)."""
    return _create("emformer_base", pretrained, **kwargs)
