/*
 * ckpt/torch.h — PyTorch files and the PyTorch / Hugging Face bridge.
 *
 * The allow-list reader and writer of torch.save files, and checkpoint
 * export to / import from PyTorch and Hugging Face folders (docs/PYTORCH.md).
 * Included by ckpt.h; may be included on its own (it includes ckpt.h).
 */
#ifndef CKPT_TORCH_H
#define CKPT_TORCH_H

#include "../ckpt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* PyTorch files (torch.save) and the PyTorch / Hugging Face bridge          */
/* ------------------------------------------------------------------------ */

/* A torch.save file is a zip archive holding a pickle (data.pkl) and one
 * record per tensor storage (docs/PYTORCH.md). The reader runs the pickle on
 * an allow-list machine that knows only what a state dict needs: dicts
 * (OrderedDict too), lists, tuples, sets, None, bools, ints (to 64 bits),
 * floats, strings, bytes, and tensors rebuilt by
 * torch._utils._rebuild_tensor_v2 / _rebuild_parameter from storages of
 * dtype F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL. Any other global, callable
 * or opcode is CKPT_EUNSUPPORTED naming it; nothing in a file can make the
 * reader run code. Malformed input (bad zip records, overlapping records, a
 * storage shorter than a tensor claims, containers that contain themselves,
 * nesting deeper than CKPT_TORCH_MAX_DEPTH...) is CKPT_ECORRUPT. Files of the
 * legacy format (PyTorch < 1.6) are CKPT_EUNSUPPORTED with a message saying
 * how to re-save them. */

/* Deepest nesting of containers a torch file may have. */
#define CKPT_TORCH_MAX_DEPTH 256

typedef enum ckpt_torch_kind {
    CKPT_TORCH_NONE = 1,
    CKPT_TORCH_BOOL = 2,
    CKPT_TORCH_INT = 3,
    CKPT_TORCH_FLOAT = 4,
    CKPT_TORCH_STR = 5,
    CKPT_TORCH_BYTES = 6,
    CKPT_TORCH_TUPLE = 7,
    CKPT_TORCH_LIST = 8,
    CKPT_TORCH_SET = 9,
    CKPT_TORCH_DICT = 10,
    CKPT_TORCH_TENSOR = 11
} ckpt_torch_kind;

/* "none", "bool", "int", "float", "str", "bytes", "tuple", "list", "set",
 * "dict", "tensor"; NULL for an invalid value. Static. */
CKPT_API const char *ckpt_torch_kind_name(ckpt_torch_kind kind);

/* One value of the tree a torch file holds. Read-only views, valid until the
 * file is closed. A value may be reachable from several places (the pickle's
 * memo shares objects, as PyTorch does for tied weights), never from itself. */
typedef struct ckpt_torch_value {
    ckpt_torch_kind kind;
    bool b;                 /* BOOL */
    int64_t i;              /* INT */
    double f;               /* FLOAT */
    const char *s;          /* STR: UTF-8, NUL-terminated; BYTES: len bytes */
    size_t len;             /* STR, BYTES: bytes (without the NUL) */
    int64_t n;              /* TUPLE, LIST, SET: items; DICT: key/value pairs */
    struct ckpt_torch_value *const *items; /* DICT: 2n, key then value, in file order */
    bool ordered;           /* DICT: a collections.OrderedDict */
    /* TENSOR: contiguous row-major data (a view into the file when the
     * tensor is contiguous in its storage, else a copy owned by the file) */
    ckpt_dtype dtype;
    int ndim;
    const int64_t *shape; /* ndim sizes (a pointer, so that other values stay small) */
    uint64_t nbytes;
    const void *data;
    bool requires_grad;
    bool parameter;         /* rebuilt as an nn.Parameter */
} ckpt_torch_value;

typedef struct ckpt_torch_file ckpt_torch_file;

/* Opens, checks and unpickles a whole torch.save file (mapped read-only). */
CKPT_API int ckpt_torch_open(ckpt_torch_file **out, const char *path);
/* The same over a caller's buffer, borrowed until the file is closed. name is
 * used in messages. */
CKPT_API int ckpt_torch_open_memory(ckpt_torch_file **out, const void *buf, size_t len,
                                    const char *name);
CKPT_API void ckpt_torch_close(ckpt_torch_file *f);
/* The object torch.save was given. View valid until the file is closed. */
CKPT_API const ckpt_torch_value *ckpt_torch_root(const ckpt_torch_file *f);
/* The value under a string key of a dict; NULL if dict is not a dict or has
 * no such key. */
CKPT_API const ckpt_torch_value *ckpt_torch_dict_get(const ckpt_torch_value *dict,
                                                     const char *key);
/* Adds v to w as a flat state dict: nested dicts, lists and tuples become
 * dotted keys ("state.0.exp_avg", "param_groups.0.betas.1") under prefix
 * (NULL or "" for none); tensors become tensors (data borrowed from the file,
 * which must stay open until w is saved or freed), ints and bools i64,
 * floats f64, strings str, bytes bytes. None and empty containers add
 * nothing. CKPT_EUNSUPPORTED for a set or a dict key that is not a string or
 * an int; key rules as ckpt_write_*. */
CKPT_API int ckpt_torch_flatten(const ckpt_torch_value *v, const char *prefix, ckpt_writer *w);

/* Writes torch.save files: build one object with begin/put/end calls (a dict
 * takes key, value, key, value...; keys are strings, ints, bools, floats or
 * None), then save. The file holds STORED zip records with 64-byte aligned
 * data and real CRC-32s and a protocol-2 pickle using only the opcodes and
 * globals torch.load(..., weights_only=True) accepts (PyTorch 1.13 to 2.x).
 * A misuse (a value where a key must be, end without begin, save of an
 * unfinished object...) is CKPT_EINVAL and spoils the writer for saving. */
typedef struct ckpt_torch_writer ckpt_torch_writer;

CKPT_API int ckpt_torch_writer_new(ckpt_torch_writer **out);
CKPT_API void ckpt_torch_writer_free(ckpt_torch_writer *w);
/* ordered: a collections.OrderedDict (what module.state_dict() returns). */
CKPT_API int ckpt_torch_begin_dict(ckpt_torch_writer *w, bool ordered);
CKPT_API int ckpt_torch_begin_list(ckpt_torch_writer *w);
CKPT_API int ckpt_torch_begin_tuple(ckpt_torch_writer *w);
/* Ends the innermost open dict, list or tuple. */
CKPT_API int ckpt_torch_end(ckpt_torch_writer *w);
CKPT_API int ckpt_torch_put_none(ckpt_torch_writer *w);
CKPT_API int ckpt_torch_put_bool(ckpt_torch_writer *w, bool v);
CKPT_API int ckpt_torch_put_int(ckpt_torch_writer *w, int64_t v);
/* A Python int from 0 to 2^64 - 1 (a u64 entry). */
CKPT_API int ckpt_torch_put_uint(ckpt_torch_writer *w, uint64_t v);
CKPT_API int ckpt_torch_put_float(ckpt_torch_writer *w, double v);
/* Copies v (valid UTF-8). */
CKPT_API int ckpt_torch_put_str(ckpt_torch_writer *w, const char *v);
/* A tensor in its own storage, or, when data is the very pointer of an
 * earlier tensor of the same dtype and byte count, in that tensor's storage
 * (torch.load then gives both one storage, as for PyTorch's tied weights).
 * Copies shape; borrows data until the writer is saved or freed. dtype: one
 * of the ten above (else CKPT_EUNSUPPORTED). */
CKPT_API int ckpt_torch_put_tensor(ckpt_torch_writer *w, ckpt_dtype dt, int ndim,
                                   const int64_t *shape, const void *data);
/* Writes the file crash-safely (temporary file, fsync, rename, folder
 * fsync). The archive's folder is the file name's stem, as torch.save names
 * it. The writer can be saved again or freed. */
CKPT_API int ckpt_torch_writer_save(ckpt_torch_writer *w, const char *path);

/* --- checkpoint <-> PyTorch / Hugging Face folders ------------------------ */

typedef struct ckpt_export_options {
    bool weights_only;        /* only the model(s): for inference and the Hub */
    uint64_t max_shard_size;  /* 0: one model.safetensors; else HF shards
                                 (model-00001-of-0000N.safetensors) of at most
                                 this many bytes (a larger tensor gets a shard
                                 of its own) + model.safetensors.index.json */
    /* The model(s) as torch.save files instead of safetensors, for PyTorch
     * without the safetensors package: pytorch_model.bin (an OrderedDict of
     * tensors, which torch.load(..., weights_only=True) opens from PyTorch
     * 1.13 on), or with max_shard_size, or when the checkpoint's model is
     * itself saved as Hugging Face shards (the same split then),
     * pytorch_model-0000k-of-0000N.bin + pytorch_model.bin.index.json as
     * transformers writes them. The k-th model is pytorch_model_<k>. */
    bool torch_bin;
} ckpt_export_options;

/* Writes an Accelerate-style folder PyTorch loads as is from a complete
 * checkpoint (verified first): model.safetensors (model_<k> for the k-th
 * model; a tied name as Hugging Face's save_model leaves it: the tensor
 * once, the __metadata__ record; in pytorch_model.bin both names on one
 * storage), optimizer.bin / scheduler.bin (torch.optim and lr_scheduler
 * state_dict() structures of PyTorch 1.13 and later), scaler.pt (a
 * GradScaler state dict), every custom object as Accelerate saves one
 * (custom_checkpoint_<i>.pkl, or <name>.pkl for a named one: torch.save of
 * its flat state dict; not with weights_only) and README.md saying what
 * does not carry over (and which custom object was left out, holding a
 * tensor PyTorch has no dtype for).
 * Crash-safe: out_dir appears complete or not at all; an existing out_dir is
 * CKPT_EEXIST. opt may be NULL (defaults). A scheduler PyTorch cannot load
 * with weights_only (multisteplr: a collections.Counter) is CKPT_EUNSUPPORTED. */
CKPT_API int ckpt_export_torch(const char *checkpoint_dir, const char *out_dir,
                               const ckpt_export_options *opt);

typedef struct ckpt_import_options {
    ckpt_optim_kind optimizer; /* 0: from the file; needed for Adam vs AdamW
                                  state with weight decay (the file cannot say) */
    const char *scheduler;     /* NULL: from the file; else a scheduler kind
                                  (docs/TRAINING.md), needed for a LambdaLR */
    int64_t warmup, total;     /* the LambdaLR schedule's steps, when the file
                                  does not carry them; -1: not given */
    int64_t step;              /* the checkpoint's step; -1: the optimizer's */
    uint64_t seed;             /* seed of random_states_0 (torch's generator
                                  state does not carry over) */
    /* The name of each of optimizer.bin's parameters, in its index order
     * (group by group), for a file without param_names (torch before 2.6);
     * each must be a tensor of the model with its state's shape. NULL: the
     * import names them itself only where the order is certain (one
     * pickled model state dict, one group, counts and shapes pairing one to
     * one), else leaves them unnamed (see ckpt_optimizer_set_match_by_position).
     * Borrowed for the call. */
    const char *const *param_names;
    int64_t num_param_names;
    /* A torch file's storage may be referenced by many tensors (a few KiB
     * of deflated zeros can stand for gigabytes), so the checkpoint's tensor
     * bytes are capped before anything is written: at most this many; 0:
     * 64 times the bytes of the files read, and at least 1 MiB. Over it:
     * CKPT_EUNSUPPORTED naming both sizes, nothing written. */
    uint64_t max_output_size;
    /* Called once (may be NULL) after SRC is read and before anything is
     * written, with the bytes of the files read and the tensor bytes the
     * checkpoint will hold, whether or not they pass the cap. */
    void (*on_sizes)(void *user, uint64_t input_bytes, uint64_t output_bytes);
    void *user;
} ckpt_import_options;

/* warmup, total and step -1; the rest 0. */
CKPT_API ckpt_import_options ckpt_import_defaults(void);

/* Makes a ckpt checkpoint at checkpoint_dir (crash-safely; an existing
 * folder is CKPT_EEXIST) from src: an Accelerate folder (model.safetensors or
 * pytorch_model.bin, sharded or not, optimizer.bin, scheduler.bin,
 * scaler.pt), a folder of Hugging Face weights, or one file (a torch.save'd
 * state dict or a .safetensors file). The checkpoint has model.safetensors,
 * optimizer / scheduler / scaler files where src has them, and
 * random_states_0 seeded with opt->seed; a program that prepares the same
 * objects loads it with ckpt_load_state (optimizer state by parameter name:
 * see ckpt_import_options.param_names). opt may be NULL (defaults).
 * CKPT_EINVAL / CKPT_EMISMATCH for parameter names that do not fit. */
CKPT_API int ckpt_import_torch(const char *src, const char *checkpoint_dir,
                               const ckpt_import_options *opt);

#ifdef __cplusplus
}
#endif

#endif /* CKPT_TORCH_H */
