/* dtype.c — the dtype table (safetensors names and bit widths) and tensor
 * byte counts: the bottom of the format layer, used by the safetensors
 * parser and by state dicts alike. */
#include <inttypes.h>
#include <stdbool.h>
#include <string.h>

#include "base/error.h"

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

