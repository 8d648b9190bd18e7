"""The products the Triton kernels share: a tile product with fp32 accumulation from full-fp32,
TF32 or bf16-rounded operands, with the rounding done explicitly so that Triton's CPU interpreter
(which computes every product in fp32) gives what the GPU's tensor cores would.

Used by the solve (``_triton_solve``: the products across spans and the gradients) and the random
features (``_triton_features``: the products of features, states and values; the feature logits
themselves stay full fp32). The measured errors of each choice are in docs/gpu.md.

"bf16" products are bf16 tensor-core instructions (the bf16 peak, twice TF32's) on operands that are
bf16 tiles already (loaded from bf16 copies: half the bytes) or fp32 tiles rounded here. Triton's
interpreter cannot multiply bf16 tiles (its ``tl.dot`` takes their raw 16-bit patterns for integers),
so under it the same bf16 values are widened to fp32 first: the same exact products, summed in fp32.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # importable without Triton (the ops then say what to install)
    triton = None
    tl = None

#: Operand precisions a product may take: CUDA cores in full fp32, or tensor cores.
OPERAND_CHOICES = ("fp32", "tf32x3", "tf32", "bf16")

if triton is not None:
    from ._backend import defined_for_the_interpreter

    @triton.jit
    def rounded(x, OPERANDS: tl.constexpr):
        """``x`` rounded to the operand precision of a tensor-core product (to nearest, ties away from
        zero, as the GPU's conversion): "tf32" keeps 10 mantissa bits, "bf16" 7, "fp32" all. Explicit,
        so that the interpreter, which computes every product in fp32, gives what the GPU would."""
        if OPERANDS == "tf32":
            return ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
        elif OPERANDS == "bf16":
            return ((x.to(tl.uint32, bitcast=True) + 0x8000) & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            return x

    # whether these kernels run under Triton's interpreter (fixed when the module is imported, as triton.jit is)
    INTERPRETED = tl.constexpr(defined_for_the_interpreter(rounded))

    @triton.jit
    def as_bf16(x):
        """``x`` as a bf16 tile: itself if it is one (loaded from a bf16 copy), else rounded to nearest
        (ties away from zero, as :func:`rounded`) and converted, which is then exact."""
        if x.dtype == tl.bfloat16:
            return x
        else:
            return rounded(x, "bf16").to(tl.bfloat16)

    @triton.jit
    def bf16_product(a, b, acc):
        """acc + a @ b from bf16 operands with fp32 accumulation: a bf16 tensor-core instruction, or
        under the interpreter (whose dot cannot take bf16) the same values widened to fp32."""
        if INTERPRETED:
            return tl.dot(as_bf16(a).to(tl.float32), as_bf16(b).to(tl.float32), acc=acc, input_precision="ieee")
        else:
            return tl.dot(as_bf16(a), as_bf16(b), acc=acc, out_dtype=tl.float32)

    @triton.jit
    def product(a, b, OPERANDS: tl.constexpr):
        """a @ b with fp32 accumulation: full fp32 ("fp32": CUDA cores), on tensor cores at fp32
        accuracy from three TF32 products ("tf32x3"), from TF32 operands ("tf32") or from bf16 ones
        ("bf16": :func:`bf16_product`; a bf16 tile is taken as it is)."""
        if OPERANDS == "fp32":
            return tl.dot(a, b, input_precision="ieee")
        elif OPERANDS == "tf32x3":
            # fp32 accuracy on tensor cores: a·b ≈ a_hi·b_hi + a_hi·b_lo + a_lo·b_hi, each part a TF32
            # number (the lo·lo term, 2^-22 relative, is dropped); Triton's own "tf32x3" does the same
            a_hi = rounded(a, "tf32")
            b_hi = rounded(b, "tf32")
            small = tl.dot(a_hi, rounded(b - b_hi, "tf32"), input_precision="tf32")
            small = tl.dot(rounded(a - a_hi, "tf32"), b_hi, acc=small, input_precision="tf32")
            return tl.dot(a_hi, b_hi, acc=small, input_precision="tf32")
        elif OPERANDS == "bf16":
            return bf16_product(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32))
        else:
            return tl.dot(rounded(a, OPERANDS), rounded(b, OPERANDS), input_precision="tf32")

    @triton.jit
    def stored_as(x, ptr):
        """fp32 ``x`` in the element type of ``ptr``, rounded to nearest: for bf16 rounded here first
        (to nearest, ties away from zero), because the interpreter's own cast truncates where the GPU's
        conversion rounds; fp16 and fp32 by the cast."""
        if ptr.dtype.element_ty == tl.bfloat16:
            x = rounded(x, "bf16")
        return x.to(ptr.dtype.element_ty)

    @triton.jit
    def product_into(a, b, acc, OPERANDS: tl.constexpr):
        """acc + a @ b as :func:`product` ("fp32", "tf32" or "bf16" operands), accumulated in place by
        the product itself: no second tile of acc's size is live (a walk's running state)."""
        if OPERANDS == "fp32":
            return tl.dot(a, b, acc=acc, input_precision="ieee")
        elif OPERANDS == "bf16":
            return bf16_product(a, b, acc)
        else:
            return tl.dot(rounded(a, OPERANDS), rounded(b, OPERANDS), acc=acc, input_precision="tf32")
