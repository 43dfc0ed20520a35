"""SEANet encoder/decoder with streamable convolutions.

Module and parameter names follow the official `encodec` package (0.1.1) so that its
checkpoints load with strict=True: `encoder.model.0.conv.conv.weight_g`,
`decoder.model.3.convtr.convtr.weight_v`, `decoder.model.1.lstm.weight_ih_l0`, ...

Streaming (decoder only). Every stateful module has
    stream_init(batch, ref) -> list[Tensor]           # initial state, batch first
    stream_step(x, states_in, states_out, started)    # consumes/produces its entries
where `states_in` is an iterator over the previous step's flat state list and the module
appends its new entries to `states_out` in the same order. `started` is None when every
session in the batch has decoded a packet before, else a bool [B] mask of those that
have (reflect padding applies only at the start of a stream).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..scripted import scripted
from .config import CodecConfig


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _param_key(module: nn.Module) -> tuple:
    """Changes whenever a parameter of `module` is replaced or updated in place
    (optimizer step, load_state_dict, .to()); inference tensors have no version."""
    return tuple((p.data_ptr(), -1 if p.is_inference() else p._version) for p in module.parameters())


def _cached(module: nn.Module, name: str, compute) -> Tensor:
    """compute() memoised on the module's parameters while autograd is off: inference
    (and every streaming step) then skips re-deriving weights."""
    if torch.is_grad_enabled():
        return compute()
    key = _param_key(module)
    hit = module.__dict__.get(name)
    if hit is None or hit[0] != key:
        hit = (key, compute())
        module.__dict__[name] = hit
    return hit[1]


class _WeightNorm:
    """Weight normalisation kept as `weight_g`/`weight_v` parameters (the official key
    names) without the deprecated torch.nn.utils.weight_norm hooks; the weight is
    computed with the same kernel as that API (bit-identical)."""

    use_weight_norm: bool

    def _setup_norm(self, norm: str) -> None:
        self.use_weight_norm = norm == "weight_norm"
        if self.use_weight_norm:
            w = self.weight.detach()
            del self.weight
            self.weight_g = nn.Parameter(torch.norm_except_dim(w, 2, 0))
            self.weight_v = nn.Parameter(w.clone())

    def effective_weight(self) -> Tensor:
        if not self.use_weight_norm:
            return self.weight
        return _cached(self, "_weight_cache", lambda: torch._weight_norm(self.weight_v, self.weight_g, 0))


class _Conv1d(_WeightNorm, nn.Conv1d):
    def __init__(self, *args, norm: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_norm(norm)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.effective_weight(), self.bias)


class _ConvTranspose1d(_WeightNorm, nn.ConvTranspose1d):
    def __init__(self, *args, norm: str, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_norm(norm)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv_transpose1d(x, self.effective_weight(), self.bias, self.stride)


class NormConv1d(nn.Module):
    """Holds the conv as `.conv` (official key path `<layer>.conv.conv.*`)."""

    def __init__(self, *args, norm: str, **kwargs):
        super().__init__()
        self.conv = _Conv1d(*args, norm=norm, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class NormConvTranspose1d(nn.Module):
    """Holds the transposed conv as `.convtr` (key path `<layer>.convtr.convtr.*`)."""

    def __init__(self, *args, norm: str, **kwargs):
        super().__init__()
        self.convtr = _ConvTranspose1d(*args, norm=norm, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        return self.convtr(x)


def _pad1d(x: Tensor, left: int, right: int, mode: str) -> Tensor:
    """F.pad that also reflects inputs shorter than the padding, as encodec does: zeros
    are appended first and cut off after the reflection."""
    if mode == "reflect":
        length = x.shape[-1]
        extra = max(left, right) - length + 1 if length <= max(left, right) else 0
        if extra:
            x = F.pad(x, (0, extra))
        y = F.pad(x, (left, right), mode="reflect")
        return y[..., : y.shape[-1] - extra]
    return F.pad(x, (left, right), mode="constant", value=0.0)


class SConv1d(nn.Module):
    """Conv1d with causal (all left) or centred padding, plus right padding so the last
    window is full (the encoder then yields ceil(T / hop) frames)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, *, causal: bool, norm: str, pad_mode: str):
        super().__init__()
        self.conv = NormConv1d(in_channels, out_channels, kernel_size, stride,
                               dilation=dilation, norm=norm)
        self.causal = causal
        self.pad_mode = pad_mode
        self.kernel_size, self.stride = kernel_size, stride
        # samples of left context a causal output needs beyond the current input sample
        self.context = (kernel_size - 1) * dilation - (stride - 1)

    def forward(self, x: Tensor) -> Tensor:
        k, s, pt = self.kernel_size, self.stride, self.context
        # encodec's formula (with the undilated kernel size): 0 for stride-1 convs
        extra = _ceil_div(x.shape[-1] - k + pt, s) * s + k - pt - x.shape[-1]
        if self.causal:
            left, right = pt, extra
        else:
            left, right = pt - pt // 2, pt // 2 + extra
        return self.conv(_pad1d(x, left, right, self.pad_mode))

    def stream_init(self, batch: int, ref: Tensor) -> list[Tensor]:
        if not self.causal or self.stride != 1:
            raise ValueError("only causal stride-1 convolutions can stream")
        if self.context == 0:
            return []
        return [ref.new_zeros(batch, self.conv.conv.in_channels, self.context)]

    def stream_step(self, x: Tensor, states_in: Iterator[Tensor], states_out: list[Tensor],
                    started: Tensor | None) -> Tensor:
        ctx = self.context
        if ctx == 0:
            return self._stream_conv(x)
        buf = next(states_in)  # the last `ctx` inputs (zeros before the first packet)
        if self.pad_mode == "reflect" and started is not None:
            # a stream's first packet is padded by reflecting its own samples 1..ctx,
            # exactly as the whole-sequence pad does; later packets use the buffer
            head = x[..., 1: ctx + 1].flip(-1)
            buf = torch.where(started[:, None, None], buf, head)
        x = torch.cat([buf, x], dim=-1)
        states_out.append(x[..., -ctx:].contiguous())
        return self._stream_conv(x)

    def window_weight(self) -> Tensor:
        """The weight as one matrix over input windows, [k * C_in, C_out]: row j * C_in + c
        is tap j of input channel c (a channels-last window's order)."""
        w = self.conv.conv.effective_weight()  # [C_out, C_in, k]
        return w.permute(2, 1, 0).reshape(-1, w.shape[0]).contiguous()

    def _stream_conv(self, x: Tensor) -> Tensor:
        """The conv of a streaming step (no padding left to add). On CPU the last layer's
        conv to one channel runs as one [k, C] matmul over every tap, then k shifted adds:
        oneDNN's conv with a single output channel was 2-5x slower (docs/loadtest.md)."""
        conv = self.conv.conv
        k = self.kernel_size
        if x.device.type != "cpu" or conv.out_channels != 1 or k == 1:
            return self.conv(x)
        w = _cached(self, "_taps", lambda: conv.effective_weight()[0].t().contiguous())  # [k, C]
        z = torch.matmul(w, x)  # [B, k, L]: tap t of every input sample
        d = conv.dilation[0]
        n = x.shape[-1] - (k - 1) * d
        y = z[:, :1, :n].clone()
        for t in range(1, k):
            y += z[:, t : t + 1, t * d : t * d + n]
        return y if conv.bias is None else y.add_(conv.bias[:, None])


class SConvTranspose1d(nn.Module):
    """ConvTranspose1d trimmed to stride * input length: causal trims all of the
    kernel_size - stride overhang on the right, non-causal splits it."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int, *,
                 causal: bool, norm: str):
        super().__init__()
        self.convtr = NormConvTranspose1d(in_channels, out_channels, kernel_size, stride, norm=norm)
        self.causal = causal
        self.stride = stride
        self.overhang = kernel_size - stride

    def forward(self, x: Tensor) -> Tensor:
        y = self.convtr(x)
        right = self.overhang if self.causal else self.overhang // 2
        left = self.overhang - right
        return y[..., left: y.shape[-1] - right]

    def _polyphase_weight(self) -> Tensor:
        """The causal transposed conv as a plain conv over input frames: output sample
        j*s + p sums taps t*s + p of inputs j - t, t < m = ceil(K / s); stacking the s
        phases as output channels gives a [O*s, C, m] kernel (taps reversed, zero-padded
        to m*s). One dense conv beats conv_transpose1d, which falls back to a slow
        col2im path for small inputs."""
        conv = self.convtr.convtr
        w = conv.effective_weight()  # [C, O, K]
        c, o, k = w.shape
        m = _ceil_div(k, self.stride)
        w = F.pad(w, (0, m * self.stride - k)).view(c, o, m, self.stride)
        return w.flip(2).permute(1, 3, 0, 2).reshape(o * self.stride, c, m).contiguous()

    def window_weight(self) -> Tensor:
        """The polyphase weight as one matrix over windows of m input frames, channels
        last: [m * C_in, s * C_out], row t * C_in + c the input channel c of frame j + t in
        the window of output frame j (whose state frames come first), column p * C_out + o
        the output channel o of sample j * s + p."""
        poly = self._polyphase_weight()  # [C_out * s, C_in, m]
        c, m = poly.shape[1:]
        return poly.view(-1, self.stride, c, m).permute(3, 2, 1, 0).reshape(m * c, -1).contiguous()

    def stream_init(self, batch: int, ref: Tensor) -> list[Tensor]:
        if not self.causal:
            raise ValueError("only causal transposed convolutions can stream")
        conv = self.convtr.convtr
        return [ref.new_zeros(batch, conv.in_channels, _ceil_div(conv.kernel_size[0], self.stride) - 1)]

    def stream_step(self, x: Tensor, states_in: Iterator[Tensor], states_out: list[Tensor],
                    started: Tensor | None) -> Tensor:
        # The state is the last m - 1 input frames: the unfinished right tail of the
        # output is exactly what they still contribute (zeros before the first packet
        # contribute nothing, as in the whole-sequence transposed conv).
        conv = self.convtr.convtr
        prev = next(states_in)
        if prev.shape[-1]:
            x = torch.cat([prev, x], dim=-1)
            states_out.append(x[..., x.shape[-1] - prev.shape[-1]:].contiguous())
        else:
            states_out.append(prev)
        weight = _cached(self, "_poly_cache", self._polyphase_weight)
        bias = None if conv.bias is None else conv.bias.repeat_interleave(self.stride)
        b, o, s = x.shape[0], conv.out_channels, self.stride
        n = x.shape[-1] - weight.shape[-1] + 1  # output frames
        if x.device.type == "cpu" and n <= 8:
            # a few frames (the first upsampling layer sees one per code frame): one GEMM
            # over [batch x frames, taps x channels] beat oneDNN's conv 2-4x (docs/loadtest.md)
            m, c = weight.shape[-1], weight.shape[1]
            w2 = _cached(self, "_poly_gemm_cache", lambda: weight.permute(2, 1, 0).reshape(m * c, o * s).contiguous())
            xt = x.transpose(1, 2)  # [B, n + m - 1, C]
            taps = torch.cat([xt[:, t : t + n] for t in range(m)], dim=-1).reshape(b * n, m * c)
            y = torch.mm(taps, w2) if bias is None else torch.addmm(bias, taps, w2)  # [B*n, O*s]
            return y.view(b, n, o, s).permute(0, 2, 1, 3).reshape(b, o, n * s)
        y = F.conv1d(x, weight, bias)  # [B, O*s, n]
        # phase-major channels -> interleaved samples
        return y.view(b, o, s, n).transpose(2, 3).reshape(b, o, n * s)


class SLSTM(nn.Module):
    """LSTM over conv layout [B, C, T] with a residual skip (official SLSTM, skip=True)."""

    def __init__(self, dimension: int, num_layers: int):
        super().__init__()
        self.lstm = nn.LSTM(dimension, dimension, num_layers)

    def forward(self, x: Tensor) -> Tensor:
        x = x.permute(2, 0, 1)
        y, _ = self.lstm(x)
        return (y + x).permute(1, 2, 0)

    def stream_init(self, batch: int, ref: Tensor) -> list[Tensor]:
        shape = (batch, self.lstm.num_layers, self.lstm.hidden_size)
        return [ref.new_zeros(shape), ref.new_zeros(shape)]

    def loop_weights(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per layer: W_ih^T, W_hh^T (contiguous) and b_ih + b_hh, with the gates reordered
        from nn.LSTM's (i, f, g, o) to (i, f, o, g), so one sigmoid covers three gates."""
        hid = self.lstm.hidden_size
        order = torch.cat([torch.arange(0, 2 * hid), torch.arange(3 * hid, 4 * hid), torch.arange(2 * hid, 3 * hid)])
        out = []
        for layer in range(self.lstm.num_layers):
            w_ih, w_hh, b_ih, b_hh = (getattr(self.lstm, f"{n}_l{layer}").detach()
                                      for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
            out.append((w_ih[order].t().contiguous(), w_hh[order].t().contiguous(), (b_ih + b_hh)[order]))
        return out

    def _cell_loop(self, seq: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """nn.LSTM's recurrence written out; seq [T, B, H], h/c [B, layers, H]."""
        hid = self.lstm.hidden_size
        hs, cs = [], []
        for layer, (w_ih, w_hh, bias) in enumerate(_cached(self, "_loop_cache", self.loop_weights)):
            gates_x = torch.addmm(bias, seq.flatten(0, 1), w_ih).view(seq.shape[0], seq.shape[1], -1)
            seq, h_l, c_l = _lstm_recurrence()(gates_x, h[:, layer], c[:, layer], w_hh, hid)
            hs.append(h_l)
            cs.append(c_l)
        return seq, torch.stack(hs, 1), torch.stack(cs, 1)

    def stream_step(self, x: Tensor, states_in: Iterator[Tensor], states_out: list[Tensor],
                    started: Tensor | None) -> Tensor:
        # (h, c) are kept batch first, [B, layers, H], so sessions gather on dim 0.
        h, c = next(states_in), next(states_in)
        inp = x.permute(2, 0, 1)
        hidden = self.lstm.hidden_size
        if torch.jit.is_tracing() or inp.shape[0] * 16384 <= hidden * hidden:
            # oneDNN's LSTM re-lays out its weights on every call (~10 ms at width 512,
            # measured), while a plain loop pays per frame: loop up to (H / 128)^2 frames.
            # A trace always loops (its loop is scripted: any frame count)
            y, h, c = self._cell_loop(inp, h, c)
        else:
            y, (h, c) = self.lstm(inp, (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))
            h, c = h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()
        states_out += [h, c]
        return (y + inp).permute(1, 2, 0)


def _recurrence(gates_x: Tensor, h: Tensor, c: Tensor, w_hh: Tensor, hid: int) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer over time: gates_x [T, B, 4H] (input part, biases in), gates in
    (i, f, o, g) order; h/c [B, H]. Returns (outputs [T, B, H], h, c)."""
    outs: list[Tensor] = []
    for t in range(gates_x.shape[0]):
        gates = torch.addmm(gates_x[t], h, w_hh)
        ifo = torch.sigmoid(gates[:, : 3 * hid])
        c = torch.addcmul(ifo[:, hid : 2 * hid] * c, ifo[:, :hid], torch.tanh(gates[:, 3 * hid :]))
        h = ifo[:, 2 * hid :] * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs), h, c


# as TorchScript: a frozen trace of the streaming decoder (models/step_graph.py) then keeps
# the loop over frames instead of unrolling one frame count
_lstm_recurrence = scripted(_recurrence)


def _stream_init(layers: list[nn.Module], batch: int, ref: Tensor) -> list[Tensor]:
    return [t for layer in layers if hasattr(layer, "stream_init") for t in layer.stream_init(batch, ref)]


_ELU_PIECE = 1 << 17  # elements: a piece's passes stay in a 1 MiB L2 cache


def _elu(x: Tensor) -> Tensor:
    """ELU (alpha 1) as exp(min(x, 0)) - 1 + max(x, 0), a cache-sized piece at a time: on
    CPU these cheap passes ran ~2x faster than F.elu's expm1 kernel, which made ELU a fifth
    of a batched streaming decode (docs/loadtest.md). Small inputs keep F.elu (one op)."""
    if torch.jit.is_tracing():  # one piece, whatever the size: a trace serves every batch
        return torch.clamp(x, max=0).exp_().sub_(1).add_(x.clamp_min(0))
    if x.device.type != "cpu" or x.numel() < 1 << 15 or not x.is_contiguous():
        return F.elu(x)
    out = torch.empty_like(x)
    flat_x, flat_out = x.view(-1), out.view(-1)
    for a in range(0, flat_x.numel(), _ELU_PIECE):
        xs, ys = flat_x[a : a + _ELU_PIECE], flat_out[a : a + _ELU_PIECE]
        torch.clamp(xs, max=0, out=ys)
        ys.exp_().sub_(1).add_(xs.clamp_min(0))
    return out


def is_unit_elu(layer: nn.Module) -> bool:
    """An ELU of alpha 1, which the streaming decoder runs as `_elu` (and the native codec
    step fuses into the next convolution's inputs)."""
    return type(layer) is nn.ELU and layer.alpha == 1.0


def _stream_seq(layers: list[nn.Module], x: Tensor, states_in: Iterator[Tensor],
                states_out: list[Tensor], started: Tensor | None) -> Tensor:
    for layer in layers:
        if hasattr(layer, "stream_step"):
            x = layer.stream_step(x, states_in, states_out, started)
        elif is_unit_elu(layer):
            x = _elu(x)
        else:
            x = layer(x)
    return x


class SEANetResnetBlock(nn.Module):
    """ELU -> conv(k, dilation) to dim // compress -> ELU -> 1x1 conv, plus a shortcut."""

    def __init__(self, dim: int, dilation: int, cfg: CodecConfig):
        super().__init__()
        hidden = dim // cfg.compress
        kw = dict(causal=cfg.causal, norm=cfg.norm, pad_mode=cfg.pad_mode)
        self.block = nn.Sequential(
            nn.ELU(), SConv1d(dim, hidden, cfg.residual_kernel_size, dilation=dilation, **kw),
            nn.ELU(), SConv1d(hidden, dim, 1, **kw),
        )
        self.shortcut = nn.Identity() if cfg.true_skip else SConv1d(dim, dim, 1, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.shortcut(x) + self.block(x)

    def stream_init(self, batch: int, ref: Tensor) -> list[Tensor]:
        return _stream_init([*self.block, self.shortcut], batch, ref)

    def stream_step(self, x: Tensor, states_in: Iterator[Tensor], states_out: list[Tensor],
                    started: Tensor | None) -> Tensor:
        y = _stream_seq(list(self.block), x, states_in, states_out, started)
        return _stream_seq([self.shortcut], x, states_in, states_out, started) + y


class SEANetEncoder(nn.Module):
    """Waveform [B, C, T] -> latent [B, dimension, ceil(T / hop)]."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        kw = dict(causal=cfg.causal, norm=cfg.norm, pad_mode=cfg.pad_mode)
        mult = 1
        layers: list[nn.Module] = [SConv1d(cfg.channels, cfg.n_filters, cfg.kernel_size, **kw)]
        for ratio in reversed(cfg.ratios):
            dim = mult * cfg.n_filters
            layers += [SEANetResnetBlock(dim, cfg.dilation_base ** j, cfg)
                       for j in range(cfg.n_residual_layers)]
            layers += [nn.ELU(), SConv1d(dim, dim * 2, ratio * 2, stride=ratio, **kw)]
            mult *= 2
        if cfg.lstm_layers:
            layers.append(SLSTM(mult * cfg.n_filters, cfg.lstm_layers))
        layers += [nn.ELU(), SConv1d(mult * cfg.n_filters, cfg.dimension, cfg.last_kernel_size, **kw)]
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


class SEANetDecoder(nn.Module):
    """Latent [B, dimension, F] -> waveform [B, C, F * hop]; streams when causal."""

    def __init__(self, cfg: CodecConfig):
        super().__init__()
        kw = dict(causal=cfg.causal, norm=cfg.norm, pad_mode=cfg.pad_mode)
        mult = 2 ** len(cfg.ratios)
        layers: list[nn.Module] = [SConv1d(cfg.dimension, mult * cfg.n_filters, cfg.kernel_size, **kw)]
        if cfg.lstm_layers:
            layers.append(SLSTM(mult * cfg.n_filters, cfg.lstm_layers))
        for ratio in cfg.ratios:
            dim = mult * cfg.n_filters
            layers += [nn.ELU(), SConvTranspose1d(dim, dim // 2, ratio * 2, ratio,
                                                  causal=cfg.causal, norm=cfg.norm)]
            layers += [SEANetResnetBlock(dim // 2, cfg.dilation_base ** j, cfg)
                       for j in range(cfg.n_residual_layers)]
            mult //= 2
        layers += [nn.ELU(), SConv1d(cfg.n_filters, cfg.channels, cfg.last_kernel_size, **kw)]
        self.model = nn.Sequential(*layers)
        self.min_first_frames = self._min_first_frames(cfg)

    def _min_first_frames(self, cfg: CodecConfig) -> int:
        """Frames the first packet of a stream needs: a reflect-padded conv with context c
        running at r samples per frame reflects input samples 1..c of the stream, so the
        first packet must bring c + 1 of them (7 frames for the official model)."""
        if cfg.pad_mode != "reflect":
            return 1
        need, rate = 1, 1
        for layer in self.model:
            if isinstance(layer, SConvTranspose1d):
                rate *= layer.stride
            for conv in layer.modules():
                if isinstance(conv, SConv1d):
                    need = max(need, _ceil_div(conv.context + 1, rate))
        return need

    def forward(self, z: Tensor) -> Tensor:
        return self.model(z)

    def stream_init(self, batch: int, ref: Tensor) -> list[Tensor]:
        return _stream_init(list(self.model), batch, ref)

    def stream_step(self, z: Tensor, states_in: Iterator[Tensor], states_out: list[Tensor],
                    started: Tensor | None) -> Tensor:
        return _stream_seq(list(self.model), z, states_in, states_out, started)
