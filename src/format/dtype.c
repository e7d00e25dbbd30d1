/* dtype.c — the dtype table (safetensors names and bit widths), tensor
 * byte counts, and conversion between F32, F16 and BF16: the bottom of the
 * format layer, used by the safetensors parser and by state dicts alike. */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "base/error.h"
#include "format/statedict.h"

static const struct {
    const char *name;
    int bits;
} dtype_table[CKPT_DTYPE_COUNT_] = {
    [CKPT_F64] = {"F64", 64},         [CKPT_F32] = {"F32", 32},
    [CKPT_F16] = {"F16", 16},         [CKPT_BF16] = {"BF16", 16},
    [CKPT_I64] = {"I64", 64},         [CKPT_I32] = {"I32", 32},
    [CKPT_I16] = {"I16", 16},         [CKPT_I8] = {"I8", 8},
    [CKPT_U8] = {"U8", 8},            [CKPT_BOOL] = {"BOOL", 8},
    [CKPT_U16] = {"U16", 16},         [CKPT_U32] = {"U32", 32},
    [CKPT_U64] = {"U64", 64},         [CKPT_F8_E5M2] = {"F8_E5M2", 8},
    [CKPT_F8_E4M3] = {"F8_E4M3", 8},  [CKPT_F8_E8M0] = {"F8_E8M0", 8},
    [CKPT_F8_E4M3FNUZ] = {"F8_E4M3FNUZ", 8}, [CKPT_F8_E5M2FNUZ] = {"F8_E5M2FNUZ", 8},
    [CKPT_C64] = {"C64", 64},         [CKPT_F4] = {"F4", 4},
    [CKPT_F6_E2M3] = {"F6_E2M3", 6},  [CKPT_F6_E3M2] = {"F6_E3M2", 6},
};

static bool dtype_valid(ckpt_dtype dt) {
    return (int)dt > 0 && (int)dt < CKPT_DTYPE_COUNT_ && dtype_table[dt].name;
}

const char *ckpt_dtype_name(ckpt_dtype dt) { return dtype_valid(dt) ? dtype_table[dt].name : NULL; }

int ckpt_dtype_bits(ckpt_dtype dt) { return dtype_valid(dt) ? dtype_table[dt].bits : 0; }

int ckpt_dtype_from_name(const char *name, ckpt_dtype *out) {
    if (name) {
        for (int i = 1; i < CKPT_DTYPE_COUNT_; i++) {
            if (dtype_table[i].name && strcmp(dtype_table[i].name, name) == 0) {
                if (out) *out = (ckpt_dtype)i;
                return CKPT_OK;
            }
        }
    }
    return ckpt__err(CKPT_EINVAL, "unknown dtype '%s'", name ? name : "(null)");
}

int ckpt_tensor_nbytes(ckpt_dtype dt, int ndim, const int64_t *shape, uint64_t *out) {
    if (!dtype_valid(dt)) return ckpt__err(CKPT_EINVAL, "tensor size: invalid dtype %d", (int)dt);
    if (ndim < 0 || ndim > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_EINVAL, "tensor size: ndim %d outside 0..%d", ndim, CKPT_MAX_NDIM);
    if (ndim > 0 && !shape) return ckpt__err(CKPT_EINVAL, "tensor size: shape is NULL");
    bool zero = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ckpt__err(CKPT_EINVAL, "tensor size: dimension %d is negative (%" PRId64 ")", i,
                             shape[i]);
        if (shape[i] == 0) zero = true;
    }
    uint64_t numel = 1;
    /* A zero dimension makes the tensor empty however large the others are. */
    for (int i = 0; i < ndim && !zero; i++) {
        if (__builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
            return ckpt__err(CKPT_EINVAL, "tensor size: element count overflows");
    }
    if (zero) numel = 0;
    uint64_t bits = (uint64_t)dtype_table[dt].bits;
    /* numel * bits / 8 without a 128-bit product: whole groups of 8
     * elements are whole bytes; the remainder must fill whole bytes too. */
    uint64_t whole = 0, rem_bits = (numel % 8) * bits;
    if (__builtin_mul_overflow(numel / 8, bits, &whole))
        return ckpt__err(CKPT_EINVAL, "tensor size: byte count overflows");
    if (rem_bits % 8)
        return ckpt__err(CKPT_EINVAL,
                         "tensor size: %" PRIu64 " elements of %s (%d bits) is not a whole number "
                         "of bytes",
                         numel, dtype_table[dt].name, dtype_table[dt].bits);
    uint64_t bytes;
    if (__builtin_add_overflow(whole, rem_bits / 8, &bytes) || bytes >= ((uint64_t)1 << 63))
        return ckpt__err(CKPT_EINVAL, "tensor size: 2^63 bytes or more");
    if (out) *out = bytes;
    return CKPT_OK;
}


/* ---- F32 / F16 / BF16 conversion ------------------------------------------
 * Bit-exact and independent of the floating-point environment: narrowing
 * rounds to nearest, ties to even, on the bits. */

static uint32_t f32_bits(const void *p) {
    uint32_t u;
    memcpy(&u, p, 4);
    return u;
}

static uint16_t bits_to_bf16(uint32_t u) {
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    /* The carry of the rounding may run into the exponent: the largest
     * values become infinity, as they should. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static uint16_t bits_to_f16(uint32_t u) {
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t x = u & 0x7fffffffu;
    if (x >= 0x7f800000u) /* infinity, or NaN made quiet with its top payload bits */
        return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x0200u | ((x >> 13) & 0x3ffu) : 0));
    /* 65520 is halfway between 65504 (the largest F16, odd mantissa) and
     * 65536: from there up everything rounds to infinity. */
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (x >= 0x38800000u) { /* normal in F16: rebias the exponent by 127 - 15 */
        uint32_t v = x - 0x38000000u;
        uint32_t q = v >> 13, rem = v & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
        return (uint16_t)(sign | q);
    }
    /* Below 2^-14: an F16 subnormal (units of 2^-24) or zero. */
    uint32_t e = x >> 23;
    if (e < 102) return sign; /* below 2^-25: rounds to zero */
    uint32_t m = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q); /* q may reach 0x400: the smallest normal, encoded alike */
}

static uint32_t f16_to_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return sign | 0x7f800000u | (mant << 13);
    if (exp != 0) return sign | ((exp + 112u) << 23) | (mant << 13);
    if (mant == 0) return sign;
    int e = -14; /* a subnormal: normalise */
    while (!(mant & 0x400u)) {
        mant <<= 1;
        e--;
    }
    return sign | ((uint32_t)(e + 127) << 23) | ((mant & 0x3ffu) << 13);
}

bool ckpt__dtype_convertible(ckpt_dtype dt) {
    return dt == CKPT_F32 || dt == CKPT_F16 || dt == CKPT_BF16;
}
static bool convertible(ckpt_dtype dt) { return ckpt__dtype_convertible(dt); }

int ckpt_dtype_convert(ckpt_dtype from, const void *src, ckpt_dtype to, void *dst, uint64_t n) {
    if (!convertible(from) || !convertible(to))
        return ckpt__err(CKPT_EINVAL, "dtype convert: %s to %s: only F32, F16 and BF16 convert",
                         ckpt_dtype_name(from) ? ckpt_dtype_name(from) : "(invalid)",
                         ckpt_dtype_name(to) ? ckpt_dtype_name(to) : "(invalid)");
    if (n == 0) return CKPT_OK;
    if (!src || !dst) return ckpt__err(CKPT_EINVAL, "dtype convert: NULL buffer");
    size_t out_size = (size_t)ckpt_dtype_bits(to) / 8;
    if (n > SIZE_MAX / 4) return ckpt__err(CKPT_EINVAL, "dtype convert: %" PRIu64 " elements", n);
    if (from == to) {
        memcpy(dst, src, (size_t)n * out_size);
        return CKPT_OK;
    }
    /* One loop per pair, each element through 32-bit bits: the compiler
     * keeps the per-element work branch-light (F32 <-> BF16 is a shift and
     * an add). */
    const uint8_t *s = src;
    uint8_t *d = dst;
    uint32_t bits;
    uint16_t h;
    if (from == CKPT_F32 && to == CKPT_BF16) {
        for (uint64_t i = 0; i < n; i++) {
            h = bits_to_bf16(f32_bits(s + 4 * i));
            memcpy(d + 2 * i, &h, 2);
        }
    } else if (from == CKPT_F32) { /* to F16 */
        for (uint64_t i = 0; i < n; i++) {
            h = bits_to_f16(f32_bits(s + 4 * i));
            memcpy(d + 2 * i, &h, 2);
        }
    } else if (from == CKPT_BF16 && to == CKPT_F32) {
        for (uint64_t i = 0; i < n; i++) {
            memcpy(&h, s + 2 * i, 2);
            bits = (uint32_t)h << 16;
            memcpy(d + 4 * i, &bits, 4);
        }
    } else if (from == CKPT_F16 && to == CKPT_F32) {
        for (uint64_t i = 0; i < n; i++) {
            memcpy(&h, s + 2 * i, 2);
            bits = f16_to_bits(h);
            memcpy(d + 4 * i, &bits, 4);
        }
    } else { /* F16 <-> BF16: exactly through F32, one rounding */
        for (uint64_t i = 0; i < n; i++) {
            memcpy(&h, s + 2 * i, 2);
            bits = from == CKPT_F16 ? f16_to_bits(h) : (uint32_t)h << 16;
            h = to == CKPT_F16 ? bits_to_f16(bits) : bits_to_bf16(bits);
            memcpy(d + 2 * i, &h, 2);
        }
    }
    return CKPT_OK;
}
