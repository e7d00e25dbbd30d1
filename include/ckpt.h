/*
 * ckpt.h — save and restore the whole state of a training run, exactly.
 *
 * This header is the manual. Every function says what it does, what it
 * returns and who owns what:
 *   "copies"            the library keeps its own copy; the caller may free.
 *   "borrows until X"   the caller keeps the memory alive and unchanged until X.
 *   "view valid until Y" a pointer into library memory, valid until Y.
 *
 * Errors: every call that can fail returns int: CKPT_OK (0) or a negative
 * ckpt_status. ckpt_errmsg() then returns a message for this thread that names
 * the file, object, key, what was expected and what was found, and the OS
 * error. No function aborts or exits on bad input. Constructors take an
 * out-parameter and every *_free(NULL) is a no-op.
 *
 * On disk a checkpoint is a folder:
 *   <project_dir>/checkpoints/checkpoint_<n>/
 *       checkpoint.json              manifest and commit record (written last)
 *       model.safetensors            a model's parameters under the names given
 *       optimizer.safetensors        (model_1, optimizer_1, ... for the 2nd, ...)
 *       scheduler.safetensors
 *       scaler.safetensors
 *       dataloader.safetensors
 *       random_states_<p>.safetensors   process p's default generator
 *       custom_checkpoint_<i>.safetensors
 *       <name>.safetensors           a named custom object
 * Every state file is a standard safetensors file: tensors as tensors, every
 * other entry (int, unsigned 64-bit int, float, string, bytes, alias) in
 * __metadata__["ckpt"], one JSON document that keeps each entry's type (see
 * docs/FORMAT.md).
 *
 * This header holds the everyday API: errors, state dicts, stateful objects,
 * the training blocks and the accelerator. The specialised parts are in
 * headers of their own, which this one includes at its end (so
 * #include <ckpt.h> gives everything) and which may be included alone:
 *   ckpt/comm.h    communicators (the process group of a multi-process save)
 *   ckpt/files.h   standalone state-dict files, checkpoint folders for tools
 *   ckpt/torch.h   PyTorch files and the PyTorch / Hugging Face bridge
 * ckpt_mpi.h (libckpt_mpi) makes a communicator from an MPI one.
 */
#ifndef CKPT_H
#define CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(CKPT_BUILDING) && defined(__GNUC__)
#define CKPT_API __attribute__((visibility("default")))
#else
#define CKPT_API
#endif

#define CKPT_VERSION_MAJOR 0
#define CKPT_VERSION_MINOR 1
#define CKPT_VERSION_PATCH 0
#define CKPT_VERSION_STRING "0.1.0"

/* Returns CKPT_VERSION_STRING of the library actually linked. */
CKPT_API const char *ckpt_version(void);

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

/* Values are stable forever. */
typedef enum ckpt_status {
    CKPT_OK = 0,
    CKPT_EINVAL = -1,        /* bad argument or call sequence */
    CKPT_EIO = -2,           /* the OS failed a read, write, fsync, rename... */
    CKPT_ENOSPC = -3,        /* no space left on the device (or quota) */
    CKPT_ENOENT = -4,        /* no such file, checkpoint or key */
    CKPT_ECORRUPT = -5,      /* a file is malformed or fails its checksum */
    CKPT_EMISMATCH = -6,     /* a file is fine but does not match the objects in memory */
    CKPT_EEXIST = -7,        /* already exists (duplicate key, registered twice...) */
    CKPT_ENOMEM = -8,        /* an allocation failed */
    CKPT_EBUSY = -9,         /* another process holds the project lock */
    CKPT_EUNSUPPORTED = -10, /* valid but not supported (newer format version...) */
    CKPT_ETIMEDOUT = -11     /* a rank did not arrive at a collective within the deadline */
} ckpt_status;

/* Static name and one-line meaning of a code, e.g. "CKPT_ECORRUPT: ...". */
CKPT_API const char *ckpt_strerror(int code);
/* This thread's last detailed error message; "" if none. View valid until the
 * next failing ckpt call on this thread. */
CKPT_API const char *ckpt_errmsg(void);
/* Clears this thread's message. */
CKPT_API void ckpt_clear_error(void);
/* Sets this thread's message (printf format; NULL clears it) and returns
 * code, for user callbacks: return ckpt_set_error(CKPT_EINVAL, "lr %g", lr);
 * The library clears the message before it calls a state_dict,
 * load_state_dict, check_state_dict or hook, and reports the message the
 * callback set; a callback that fails without one is reported as "<callback>
 * returned CKPT_X". A callback that probes (ckpt_reader_find of a key that
 * may be absent sets "no key ...") and then fails for another reason should
 * set its own message. */
CKPT_API int ckpt_set_error(int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ------------------------------------------------------------------------ */
/* Data types, named as safetensors names them                               */
/* ------------------------------------------------------------------------ */

typedef enum ckpt_dtype {
    CKPT_DTYPE_INVALID = 0,
    CKPT_F64 = 1,
    CKPT_F32 = 2,
    CKPT_F16 = 3,
    CKPT_BF16 = 4,
    CKPT_I64 = 5,
    CKPT_I32 = 6,
    CKPT_I16 = 7,
    CKPT_I8 = 8,
    CKPT_U8 = 9,
    CKPT_BOOL = 10,
    CKPT_U16 = 11,
    CKPT_U32 = 12,
    CKPT_U64 = 13,
    CKPT_F8_E5M2 = 14,
    CKPT_F8_E4M3 = 15,
    CKPT_F8_E8M0 = 16,
    CKPT_F8_E4M3FNUZ = 17,
    CKPT_F8_E5M2FNUZ = 18,
    CKPT_C64 = 19,
    CKPT_F4 = 20,      /* 4 bits an element: prod(shape)*4 must be a multiple of 8 */
    CKPT_F6_E2M3 = 21, /* 6 bits an element */
    CKPT_F6_E3M2 = 22,
    CKPT_DTYPE_COUNT_ = 23
} ckpt_dtype;

/* "F32", "BF16", ...; NULL for an invalid value. Static string. */
CKPT_API const char *ckpt_dtype_name(ckpt_dtype dt);
/* Parses a safetensors dtype name; CKPT_EINVAL if unknown. */
CKPT_API int ckpt_dtype_from_name(const char *name, ckpt_dtype *out);
/* Bits per element (4, 6, 8, 16, 32, 64); 0 for an invalid value. */
CKPT_API int ckpt_dtype_bits(ckpt_dtype dt);

/* Most dimensions a tensor may have. */
#define CKPT_MAX_NDIM 16
/* Longest key, in bytes, excluding the terminating NUL. */
#define CKPT_MAX_KEY 1024

/* Bytes of a tensor of this dtype and shape, overflow-checked. ndim 0 is a
 * scalar (one element). CKPT_EINVAL on a bad dtype, ndim outside
 * 0..CKPT_MAX_NDIM, a negative dimension, a sub-byte dtype whose bits do not
 * fill whole bytes, or a size of 2^63 bytes or more. */
CKPT_API int ckpt_tensor_nbytes(ckpt_dtype dt, int ndim, const int64_t *shape, uint64_t *out);

/* ------------------------------------------------------------------------ */
/* State dicts: what a stateful object writes and reads                      */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_writer ckpt_writer;
typedef struct ckpt_reader ckpt_reader;

/* Keys: 1..CKPT_MAX_KEY bytes of UTF-8, no control characters, not
 * "__metadata__", unique within one state dict (a tensor and a scalar may not
 * share a key). Anything else is CKPT_EINVAL (CKPT_EEXIST for a duplicate). */

/* Adds a tensor. Copies key and shape; borrows data until the writer is saved
 * or freed (no copy of tensor data is ever made). data may be NULL only when
 * the tensor has 0 bytes or the writer is a schema writer. */
CKPT_API int ckpt_write_tensor(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                               const int64_t *shape, const void *data);
CKPT_API int ckpt_write_i64(ckpt_writer *w, const char *key, int64_t v);
/* Every 64-bit unsigned value, exactly (a seed, a generator's state, a byte
 * count): a u64 entry, read back only by ckpt_read_u64 (an i64 entry is not
 * a u64 one, whatever its value). */
CKPT_API int ckpt_write_u64(ckpt_writer *w, const char *key, uint64_t v);
/* Exact: the bits of every finite value, infinities and NaN round-trip. */
CKPT_API int ckpt_write_f64(ckpt_writer *w, const char *key, double v);
/* Copies v, which must be valid UTF-8. */
CKPT_API int ckpt_write_str(ckpt_writer *w, const char *key, const char *v);
/* Copies n bytes from p. */
CKPT_API int ckpt_write_bytes(ckpt_writer *w, const char *key, const void *p, size_t n);
/* A second name of a tensor (tied weights): alias names the tensor target,
 * which this writer already holds (written whole with ckpt_write_tensor, not
 * an alias itself). The file holds target's bytes once and records "alias
 * is target" (docs/FORMAT.md, the "alias" entry); a reader gives alias's reads
 * target's tensor, and lists alias as an entry of kind CKPT_ENTRY_ALIAS.
 * Key rules as above; CKPT_ENOENT if target is no tensor of w. */
CKPT_API int ckpt_write_alias(ckpt_writer *w, const char *alias, const char *target);

/* Reads a tensor into dst, which has room for exactly its bytes. dtype, ndim
 * and shape must match the file exactly, else CKPT_EMISMATCH naming the key,
 * what is in the file and what was asked for. CKPT_ENOENT if there is no such
 * key (or it is not a tensor). An alias reads its target. */
CKPT_API int ckpt_read_tensor(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                              const int64_t *shape, void *dst);
CKPT_API int ckpt_read_i64(ckpt_reader *r, const char *key, int64_t *v);
CKPT_API int ckpt_read_u64(ckpt_reader *r, const char *key, uint64_t *v);
CKPT_API int ckpt_read_f64(ckpt_reader *r, const char *key, double *v);
/* Copies the string with its NUL into buf; CKPT_EINVAL if cap is too small. */
CKPT_API int ckpt_read_str(ckpt_reader *r, const char *key, char *buf, size_t cap);
/* Copies up to cap bytes; *n = the entry's length (CKPT_EINVAL if > cap). */
CKPT_API int ckpt_read_bytes(ckpt_reader *r, const char *key, void *buf, size_t cap, size_t *n);

/* --- sharded tensors (a tensor split across processes) -------------------- */

/* Adds this process's chunk of a tensor whose whole ("global") shape is
 * global_shape: the chunk starts at offsets[d] in every dimension d and has
 * local_shape (offsets[d] + local_shape[d] <= global_shape[d]). data holds the
 * chunk's elements row-major (borrowed like ckpt_write_tensor's). In a
 * checkpoint every process writes its chunks into its own file
 * <object>-<r+1>-of-<P>.safetensors (5 digits each, as Hugging Face names
 * shards) and the manifest records every chunk, so any process count can
 * read any slice back (ckpt_read_tensor_shard). The chunks of all processes
 * must cover the tensor exactly (no holes, no overlap), else the save fails
 * with CKPT_EINVAL naming the key. CKPT_EINVAL for bounds or a sub-byte
 * dtype whose chunk is not whole bytes. */
CKPT_API int ckpt_write_tensor_shard(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                                     const int64_t *global_shape, const int64_t *offsets,
                                     const int64_t *local_shape, const void *data);
/* Reads the slice [offsets, offsets + local_shape) of the sharded tensor key
 * (global_shape and dtype must match the saved ones exactly, else
 * CKPT_EMISMATCH) into dst (room for exactly the slice), assembled from every
 * saved chunk that overlaps it, whatever process count saved it. A tensor
 * saved with ckpt_write_tensor can be read this way too (one chunk), and a
 * sharded one with ckpt_read_tensor (the whole tensor). */
CKPT_API int ckpt_read_tensor_shard(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                                    const int64_t *global_shape, const int64_t *offsets,
                                    const int64_t *local_shape, void *dst);

/* --- memory ckpt cannot touch (device memory) ------------------------------
 * A tensor whose bytes live where the library cannot dereference a pointer
 * (an accelerator's memory, a remote buffer) is named by a handle and the
 * caller's two copy functions. The library never dereferences the handle:
 * byte k of the tensor is byte `offset` k of it, moved only by
 *   to_host(handle, offset, dst, n):   bytes [offset, offset + n) of the
 *                                      tensor into host memory at dst;
 *   from_host(handle, offset, src, n): n host bytes at src into bytes
 *                                      [offset, offset + n) of the tensor.
 * Each returns 0, or on failure a negative ckpt_status (any other value is
 * reported as CKPT_EIO), optionally with ckpt_set_error's message; the save
 * or load then fails naming the tensor. The calls are synchronous (the bytes
 * are in place when a call returns), one at a time, each of at most
 * CKPT_MEMORY_PIECE bytes, and always in the thread that called the save or
 * load (an asynchronous save copies such tensors into its staging area
 * before ckpt_save_state_async returns; its background thread never calls
 * them). Where the bytes go (docs/CHECKPOINTS.md, "Memory behind ops"):
 * a save writes each piece to_host gives (through a buffer of one piece;
 * an incremental save's hash reads the tensor once more), an asynchronous
 * save copies to_host straight into its staging area (one copy); a load
 * calls from_host only with bytes already verified against the manifest
 * (a load that reads the file once: each verified piece of at most
 * 256 KiB); with several processes each rank moves only its rows of a
 * replicated tensor, its share of ZeRO-1 state and the streamed pieces it
 * receives. */
typedef struct ckpt_memory_ops {
    int (*to_host)(void *handle, uint64_t offset, void *dst, uint64_t n);
    int (*from_host)(void *handle, uint64_t offset, const void *src, uint64_t n);
} ckpt_memory_ops;
/* The most bytes one to_host or from_host call moves. */
#define CKPT_MEMORY_PIECE ((uint64_t)8 << 20)

/* ckpt_write_tensor of a tensor behind memory ops (both functions set; ops
 * and handle borrowed until the writer is saved or freed): nothing is read
 * until the writer's file is written (or staged). A standalone
 * ckpt_writer_save writes it too. */
CKPT_API int ckpt_write_tensor_mem(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                                   const int64_t *shape, const ckpt_memory_ops *ops, void *handle);
/* ckpt_read_tensor into a tensor behind memory ops: the same checks first,
 * then the bytes through from_host in pieces. */
CKPT_API int ckpt_read_tensor_mem(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                                  const int64_t *shape, const ckpt_memory_ops *ops, void *handle);

/* ------------------------------------------------------------------------ */
/* Stateful objects                                                          */
/* ------------------------------------------------------------------------ */

/* Anything with state_dict / load_state_dict (and, optionally,
 * check_state_dict). state_dict puts every entry (it may be called with a
 * schema writer: it must put the same keys, dtypes and shapes whatever the
 * writer). load_state_dict gets every entry; ckpt_load_state calls it only
 * after the file has been checked against the schema and, where the object
 * has one, by check_state_dict, so it should fail only on values it cannot
 * accept (and then change nothing). An initializer that omits
 * check_state_dict leaves it NULL: {sd, lsd} still compiles (GCC's and
 * Clang's -Wmissing-field-initializers, part of -Wextra, warn about it; the
 * designated form {.state_dict = sd, .load_state_dict = lsd} does not).
 * Every built-in kind's ops have all three; their load_state_dict is their
 * check_state_dict followed by the commit. */
typedef struct ckpt_stateful_ops {
    int (*state_dict)(void *self, ckpt_writer *w);
    int (*load_state_dict)(void *self, ckpt_reader *r);
    /* Optional (may be NULL): checks every value load_state_dict would read
     * and refuse, changing nothing. ckpt_load_state calls it for every object
     * before any load_state_dict, so a value an object would refuse stops the
     * load before anything in memory changed. It sees every object as it was
     * before the load. Returns 0 or the error load_state_dict would return. */
    int (*check_state_dict)(void *self, ckpt_reader *r);
} ckpt_stateful_ops;

/* ------------------------------------------------------------------------ */
/* Communicators: many processes (ckpt/comm.h)                              */
/* ------------------------------------------------------------------------ */

/* A process group (the struct is in ckpt/comm.h, included below). */
typedef struct ckpt_comm ckpt_comm;

/* ------------------------------------------------------------------------ */
/* Random numbers: Philox4x32-10                                             */
/* ------------------------------------------------------------------------ */

/* A counter-based generator: state is (key, counter, position in the 4-word
 * block, a cached normal). Plain struct so it can live on the stack or inside
 * other objects; treat the fields as private. */
typedef struct ckpt_rng {
    uint32_t key[2];
    uint32_t counter[4];
    uint32_t block[4];   /* output of the current counter */
    uint32_t pos;        /* words of block used, 0..4 (4 = draw a new block) */
    uint32_t has_normal; /* 1 if normal is a cached second Box-Muller value */
    double normal;
} ckpt_rng;

/* Seeds the stream: key = seed, counter = 0. */
CKPT_API void ckpt_rng_seed(ckpt_rng *g, uint64_t seed);
/* An independent stream: key = seed, counter high words = stream. Streams of
 * one seed never overlap (each has 2^64 blocks). */
CKPT_API void ckpt_rng_seed_stream(ckpt_rng *g, uint64_t seed, uint64_t stream);
CKPT_API uint32_t ckpt_rng_u32(ckpt_rng *g);
CKPT_API uint64_t ckpt_rng_u64(ckpt_rng *g);
/* Uniform in [0,1), 53 random bits. */
CKPT_API double ckpt_rng_uniform(ckpt_rng *g);
/* Uniform in [0,1) as float, 24 random bits. */
CKPT_API float ckpt_rng_uniform_f32(ckpt_rng *g);
/* Standard normal (Box-Muller; the second value is cached). */
CKPT_API double ckpt_rng_normal(ckpt_rng *g);
/* Uniform integer in [0, n) without bias; 0 if n == 0. */
CKPT_API uint64_t ckpt_rng_below(ckpt_rng *g, uint64_t n);
/* One Philox4x32-10 block: out = philox(counter, key). For known-answer tests. */
CKPT_API void ckpt_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
/* State dict of a generator: "key" (U32 [2]), "counter" (U32 [4]), "block"
 * (U32 [4], the current block's words), "pos", "has_normal" (i64) and
 * "normal" (f64); loading continues the stream exactly, mid-block and with a
 * cached normal. */
CKPT_API const ckpt_stateful_ops *ckpt_rng_ops(void);

/* ------------------------------------------------------------------------ */
/* Models: named parameter tensors the caller owns                           */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_model ckpt_model;

CKPT_API int ckpt_model_new(ckpt_model **out);
CKPT_API void ckpt_model_free(ckpt_model *m);
/* Adds a parameter. Copies name and shape; borrows data and grad (of the
 * parameter's dtype; NULL for a parameter ckpt's optimizers do not update:
 * a frozen one, or one an external optimizer's caller updates) until the
 * model is freed. Names follow the key rules; a duplicate is CKPT_EEXIST. */
CKPT_API int ckpt_model_add_param(ckpt_model *m, const char *name, ckpt_dtype dt, int ndim,
                                  const int64_t *shape, void *data, void *grad);
/* Adds a parameter whose values live behind memory ops (device memory; see
 * ckpt_memory_ops): saved, loaded, sharded and exported as any parameter,
 * its bytes moved only through ops (borrowed, with handle, until the model
 * is freed). A parameter behind ops has no gradient buffer ckpt knows of:
 * its gradient is the caller's, next to its values, and so is its update.
 * It is trainable when it is in an optimizer's group (ckpt_model_set_frozen
 * says otherwise), and the optimizer that updates it is an external one
 * (ckpt_optimizer_external_new, with its state where the caller keeps it:
 * ckpt_optimizer_set_state_mem); ckpt's own optimizers update host memory
 * only, so they refuse a trainable parameter behind ops (CKPT_EUNSUPPORTED
 * naming it) and take a frozen one. ops needs both functions (CKPT_EINVAL);
 * the rest as ckpt_model_add_param. */
CKPT_API int ckpt_model_add_param_mem(ckpt_model *m, const char *name, ckpt_dtype dt, int ndim,
                                      const int64_t *shape, const ckpt_memory_ops *ops,
                                      void *handle);
/* Tied weights (GPT-2's lm_head.weight is transformer.wte.weight): alias
 * becomes a second name of the parameter target (or of target's own target,
 * if target is itself an alias). The pair is ONE parameter: one buffer (the
 * target's), one gradient, one optimizer state (an optimizer skips tied
 * names), frozen together. A checkpoint holds its bytes once, under target's
 * name, and records the alias (docs/FORMAT.md, the "alias" entry); a load fills the
 * one buffer. alias is added as a new name (appended: ckpt_model_param lists
 * it after the parameters before it); if it already names target's
 * parameter the call does nothing. CKPT_ENOENT if target is no parameter,
 * CKPT_EEXIST if alias is already a parameter of its own or tied elsewhere,
 * CKPT_EINVAL for a bad name.
 * ckpt_model_add_param ties without this call: a parameter registered on the
 * very data pointer of an earlier one, with the same dtype and shape, becomes
 * its alias (a different gradient buffer is then CKPT_EINVAL: a tied pair has
 * one gradient; NULL, or the same buffer, is fine).
 * Loads: a file where the two names are tied, and memory where they are
 * not, or the reverse, is CKPT_EMISMATCH naming both (the files hold one
 * tensor where memory expects two, or the reverse); a file without the
 * alias at all (Hugging Face's files leave tied names out) loads: the
 * target fills the one buffer. */
CKPT_API int ckpt_model_tie(ckpt_model *m, const char *alias, const char *target);
/* Parameter names, tied ones included. */
CKPT_API int64_t ckpt_model_num_params(const ckpt_model *m);
/* Sum of the elements of the distinct parameters (a tied pair counts once,
 * as PyTorch's sum(p.numel() for p in model.parameters())). */
CKPT_API int64_t ckpt_model_num_elements(const ckpt_model *m);
typedef struct ckpt_param_info {
    const char *name;  /* view valid until the model is freed */
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    int64_t numel;
    void *data; /* NULL for a parameter behind memory ops */
    void *grad;
    bool frozen; /* see ckpt_model_set_frozen */
    /* A tied name (ckpt_model_tie): the parameter it is another name of
     * (view valid until the model is freed); data, grad and frozen are that
     * parameter's. NULL for a parameter of its own. */
    const char *tied_to;
    const ckpt_memory_ops *mem_ops; /* ckpt_model_add_param_mem's, or NULL */
    void *mem_handle;
} ckpt_param_info;
CKPT_API int ckpt_model_param(const ckpt_model *m, int64_t i, ckpt_param_info *info);
/* Marks every parameter whose name is pattern or matches it as a glob
 * (fnmatch: '*', '?', '[...]'; "fc1.*") frozen (frozen = true) or trainable.
 * Frozen means not optimized, as requires_grad=False in PyTorch: an
 * optimizer keeps no state for a frozen parameter and never updates it (it
 * stays in its group, with its index, as PyTorch keeps it). Frozen after
 * the optimizer has state for it, the state is dropped at the optimizer's
 * next step, save or load (a later unfreeze starts from fresh state: zeros,
 * step 0, as a new parameter). A checkpoint saved before the freeze loads:
 * the parameter's value from the model's file, its optimizer state in the
 * file skipped (logged once); one saved while frozen loads into a trainable
 * parameter with fresh state (logged once). docs/TRAINING.md, "Frozen
 * parameters". Without a call, a parameter in a group of an optimizer is
 * trainable (whatever its gradient buffer), one in no group
 * (ckpt_optimizer_set_groups, group -1) frozen, and before any optimizer
 * has the model, one without a gradient buffer frozen.
 * Frozen parameters never change, so a checkpoint keeps them apart: a model
 * with both frozen and trainable parameters, saved by one process (and not
 * as Hugging Face shards), writes its trainable ones to <model>.safetensors
 * and its frozen ones to <model>.frozen.safetensors (format version 3,
 * docs/FORMAT.md), which later saves link instead of writing again, as
 * often as ckpt_project_config.link_copies allows (never with
 * no_link_unchanged). Loads, verify, export and
 * ckpt_torch read the model from both files. Returns how many parameters
 * matched (> 0), or CKPT_ENOENT naming the pattern if none did. */
CKPT_API int ckpt_model_set_frozen(ckpt_model *m, const char *pattern, bool frozen);
/* State dict: every parameter as a tensor under its name, and every tied
 * name as an alias of its parameter (ckpt_write_alias), nothing else. */
CKPT_API const ckpt_stateful_ops *ckpt_model_ops(void);

/* ------------------------------------------------------------------------ */
/* Optimizers (state dict keys mirror PyTorch's)                             */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_optimizer ckpt_optimizer;

typedef enum ckpt_optim_kind {
    CKPT_OPTIM_SGD = 1,
    CKPT_OPTIM_ADAM = 2,
    CKPT_OPTIM_ADAMW = 3,
    CKPT_OPTIM_RMSPROP = 4
} ckpt_optim_kind;

/* Every hyper-parameter of one parameter group (PyTorch's names). */
typedef struct ckpt_optim_options {
    double lr;
    double momentum;      /* SGD, RMSprop */
    double dampening;     /* SGD */
    double weight_decay;
    bool nesterov;        /* SGD */
    bool maximize;
    double beta1, beta2;  /* Adam/AdamW */
    double eps;           /* Adam/AdamW, RMSprop */
    bool amsgrad;         /* Adam/AdamW */
    double alpha;         /* RMSprop: smoothing of the squared gradients' average */
    bool centered;        /* RMSprop: divide by the gradients' estimated variance */
    /* BF16/F16 parameters of the group keep an fp32 master copy: ckpt's
     * optimizers update the master from the gradient (the parameter's dtype,
     * widened exactly) and write the parameter back rounded to nearest even;
     * saved as state.<i>.master (F32, the parameter's shape) in the
     * optimizer's file, the parameters themselves in the model's. Where a
     * parameter's value is not its master's rounding (initialised or loaded
     * after the optimizer was made), the next step or save first takes the
     * parameter's value into the master. External optimizers attach their
     * masters as field "master". No effect on F32 parameters. Not a PyTorch
     * field: not in param_groups. Default false. */
    bool master_weights;
} ckpt_optim_options;

/* PyTorch's defaults for a kind (SGD lr 1e-3; Adam lr 1e-3, betas (0.9,
 * 0.999), eps 1e-8; AdamW the same with weight_decay 1e-2; RMSprop lr 1e-2,
 * alpha 0.99, eps 1e-8). */
CKPT_API ckpt_optim_options ckpt_optim_defaults(ckpt_optim_kind kind);

/* An optimizer over all of m's parameters in one group (frozen ones keep no
 * state: ckpt_model_set_frozen), one state per distinct parameter (a tied
 * name is its parameter, ckpt_model_tie). Trainable parameters are F32, or
 * BF16/F16 with opt->master_weights (else CKPT_EUNSUPPORTED naming the
 * parameter).
 * Borrows m until the optimizer is freed. */
CKPT_API int ckpt_optimizer_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                                const ckpt_optim_options *opt);
/* Contract shortcuts. SGD: dampening 0, no maximize. AdamW: amsgrad off. */
CKPT_API int ckpt_sgd_new(ckpt_optimizer **out, ckpt_model *m, double lr, double momentum,
                          double weight_decay, bool nesterov);
CKPT_API int ckpt_adam_new(ckpt_optimizer **out, ckpt_model *m, double lr, double beta1,
                           double beta2, double eps, double weight_decay);
CKPT_API int ckpt_adamw_new(ckpt_optimizer **out, ckpt_model *m, double lr, double beta1,
                            double beta2, double eps, double weight_decay);
/* torch.optim.RMSprop, bit for bit (no maximize): square_avg = alpha *
 * square_avg + (1 - alpha) * g^2; with centered, grad_avg likewise and the
 * denominator sqrt(square_avg - grad_avg^2) + eps; with momentum > 0 a
 * momentum_buffer. State keys as PyTorch's (state.<i>.square_avg,
 * .momentum_buffer, .grad_avg). */
CKPT_API int ckpt_rmsprop_new(ckpt_optimizer **out, ckpt_model *model, double lr, double alpha,
                              double eps, double weight_decay, double momentum, bool centered);
CKPT_API void ckpt_optimizer_free(ckpt_optimizer *o);
/* Splits parameters into groups: group_of[i] is the group of the model's i-th
 * parameter (0..ngroups-1, or -1: in no group, not optimized, and frozen
 * unless ckpt_model_set_frozen says otherwise), opts[g] the options of
 * group g; no group may be empty. A tied name's entry is ignored: it is its
 * parameter (ckpt_model_tie). State is numbered as PyTorch does: group 0's
 * parameters first. Only before the first step. Copies both arrays. An
 * external optimizer keeps the state attached to each parameter where its
 * new group has the field. */
CKPT_API int ckpt_optimizer_set_groups(ckpt_optimizer *o, int ngroups, const int *group_of,
                                       const ckpt_optim_options *opts);
CKPT_API int ckpt_optimizer_num_groups(const ckpt_optimizer *o);
CKPT_API double ckpt_optimizer_get_lr(const ckpt_optimizer *o, int group);
CKPT_API int ckpt_optimizer_set_lr(ckpt_optimizer *o, int group, double lr);
/* One update of every trainable parameter from its gradient (frozen ones
 * are skipped). CKPT_EINVAL, nothing updated, if a trainable parameter has
 * no gradient buffer, or if o is external (ckpt_optimizer_external_new). */
CKPT_API int ckpt_optimizer_step(ckpt_optimizer *o);
/* Sets every gradient to zero. */
CKPT_API void ckpt_optimizer_zero_grad(ckpt_optimizer *o);
/* The optimizer's step count: how many updates it made (or was told of).
 * It is what PyTorch keeps per parameter as state[p]["step"] (saved as
 * state.<i>.step, a float32, for every kind): ckpt_optimizer_step adds one
 * to every trainable parameter's count, a load restores them (a frozen
 * parameter has no state, so no count). get_step returns the largest count
 * (all are equal unless set otherwise), 0 for an optimizer without
 * trainable parameters or NULL. set_step gives every trainable parameter
 * the count step, for an optimizer whose update the caller runs
 * or to carry a count over; afterwards set_groups and set_shard refuse as
 * after a first step when step > 0. CKPT_EINVAL for step outside
 * 0..2^24 (a float32 counts exactly up to there). Unless
 * ckpt_accelerator_set_step was called, an accelerator's step is the
 * count of its first prepared optimizer (ckpt_accelerator_step). */
CKPT_API int ckpt_optimizer_set_step(ckpt_optimizer *o, int64_t step);
CKPT_API int64_t ckpt_optimizer_get_step(const ckpt_optimizer *o);
CKPT_API const ckpt_stateful_ops *ckpt_optimizer_ops(void);
/* Optimizer state names each state index's parameter (param_names.<i>) and
 * a load matches state to parameters by those names. State without names
 * (imported from a torch 1.13 optimizer.bin whose order ckpt import could
 * not prove, or saved before the names existed) is refused with
 * CKPT_EMISMATCH, since two same-shaped parameters registered in another
 * order would silently get each other's moments. With on = true such state
 * loads by position (state index i to this optimizer's i-th parameter, as
 * PyTorch does), and the load logs a warning saying so. Named state always
 * loads by name. Default off. */
CKPT_API void ckpt_optimizer_set_match_by_position(ckpt_optimizer *o, bool on);
/* ZeRO-1: from now on o keeps its state (momentum, Adam moments, masters)
 * only for this rank's contiguous share of the flattened trainable
 * parameters (frozen ones are not split, nor updated), and
 * ckpt_optimizer_step is collective over comm (borrowed until o is freed):
 * each rank updates its share from the (already averaged) gradients, then
 * the ranks exchange the updated values so every rank holds all parameters.
 * The state is saved as sharded tensors under PyTorch's keys, so a
 * checkpoint saved by P ranks loads on any other count (and unsharded).
 * Only before the first step. See docs/DISTRIBUTED.md. */
CKPT_API int ckpt_optimizer_set_shard(ckpt_optimizer *o, const ckpt_comm *comm);

/* An optimizer whose update the caller runs (its own AdamW over its own
 * moment buffers): ckpt keeps the kind, the groups (ckpt_optimizer_set_groups
 * works as for ckpt_optimizer_new), the learning rates and the step count,
 * and borrows the caller's state buffers, attached below. They are saved,
 * loaded, ZeRO-1-sharded and resharded (ckpt_optimizer_set_shard: the
 * buffers still hold whole parameters' state; each rank saves and loads its
 * share of it), linked when unchanged, exported to optimizer.bin and
 * imported exactly as ckpt's own optimizer of that kind: same files, same
 * keys. Fields are PyTorch's state keys: "exp_avg", "exp_avg_sq",
 * "max_exp_avg_sq" (amsgrad) for Adam/AdamW; "momentum_buffer" (momentum
 * != 0) for SGD; "square_avg", "momentum_buffer" (momentum > 0), "grad_avg"
 * (centered) for RMSprop; and "master" for a BF16/F16 parameter of a group
 * with master_weights. Every field is F32 with the parameter's shape (its
 * numel floats). Every trainable parameter must have every field of its
 * group when the optimizer is prepared, saved or loaded (CKPT_EINVAL naming
 * the first missing one); frozen parameters (ckpt_model_set_frozen) have
 * none. ckpt_optimizer_step on it is CKPT_EINVAL; ckpt_optimizer_set_step
 * tells the count. Parameters may be of any dtype. */
CKPT_API int ckpt_optimizer_external_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                                         const ckpt_optim_options *opts);
/* Attaches data (numel floats, borrowed until o is freed) as field of the
 * parameter named param. Replaces an earlier attachment. CKPT_ENOENT if no
 * parameter of o's groups has that name; CKPT_EINVAL for a frozen parameter
 * or a field its group does not have (the message lists those it has). */
CKPT_API int ckpt_optimizer_set_state(ckpt_optimizer *o, const char *param, const char *field,
                                      void *data);
/* Attaches field for every trainable parameter at once, for state laid out
 * like a contiguous parameter block: a parameter whose data is element k of
 * the block at params_base (k counted in the parameter's dtype: F32, BF16 or
 * F16) gets the floats from element k of state_base on. CKPT_EINVAL, with
 * nothing attached, if a trainable parameter lies before params_base or is
 * not a whole number of elements from it; a parameter that lives outside the
 * block cannot be told apart, so attach such ones with set_state after.
 * Parameters behind memory ops have no address and are skipped: attach
 * theirs with ckpt_optimizer_set_state_mem. */
CKPT_API int ckpt_optimizer_set_state_block(ckpt_optimizer *o, const char *field, void *state_base,
                                            const void *params_base);
/* ckpt_optimizer_set_state for state behind memory ops (device memory; see
 * ckpt_memory_ops): the field's numel floats are bytes [0, 4 * numel) of
 * handle, moved only through ops (borrowed, with handle, until o is freed);
 * saved, loaded, ZeRO-1-sharded (each rank moves its share only) and
 * exported as host state. A parameter and its fields may each live on
 * either side. Replaces an earlier attachment, host or not. */
CKPT_API int ckpt_optimizer_set_state_mem(ckpt_optimizer *o, const char *param, const char *field,
                                          const ckpt_memory_ops *ops, void *handle);

/* ------------------------------------------------------------------------ */
/* Learning-rate schedulers (drive every group of one optimizer)             */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_scheduler ckpt_scheduler;

/* Each constructor sets the optimizer's learning rates to their values at
 * step 0, as PyTorch's do. Borrows o until the scheduler is freed.
 *
 * Schedule parameters belong to the constructor. A scheduler's state dict
 * holds its position (last_epoch, _step_count, base_lrs, _last_lr) and, for
 * reference, the parameters it was built with (step_size, gamma, milestones,
 * T_max, eta_min, warmup, total). Loading restores the position only: the
 * parameters given to the constructor stay in force, whatever the file says,
 * as with PyTorch's LambdaLR (whose lambda is not in its state dict; the
 * warmup kinds are transformers' LambdaLR schedules). So a run resumed with a
 * larger total continues on the longer schedule from the restored step, and
 * one resumed with the same values continues exactly. (PyTorch's StepLR,
 * MultiStepLR, ExponentialLR and CosineAnnealingLR would instead take the
 * file's values silently.) The number of milestones is part of the schema: a
 * file with another count is CKPT_EMISMATCH. */
CKPT_API int ckpt_steplr_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t step_size,
                             double gamma);
CKPT_API int ckpt_multisteplr_new(ckpt_scheduler **out, ckpt_optimizer *o, int nmilestones,
                                  const int64_t *milestones, double gamma);
CKPT_API int ckpt_exponentiallr_new(ckpt_scheduler **out, ckpt_optimizer *o, double gamma);
CKPT_API int ckpt_cosinelr_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t t_max,
                               double eta_min);
/* Linear warmup from 0 over warmup steps, then cosine decay to 0 at total
 * steps (transformers' get_cosine_schedule_with_warmup, num_cycles 0.5). */
CKPT_API int ckpt_warmup_cosine_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup,
                                    int64_t total);
/* Linear warmup, then linear decay to 0 at total steps. */
CKPT_API int ckpt_warmup_linear_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup,
                                    int64_t total);
/* Constant learning rate, after an optional linear warmup (0 = none). */
CKPT_API int ckpt_constant_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup);
CKPT_API void ckpt_scheduler_free(ckpt_scheduler *s);
/* Advances one step and sets the optimizer's learning rates. */
CKPT_API int ckpt_scheduler_step(ckpt_scheduler *s);
/* The learning rate of a group after the last step (PyTorch's get_last_lr). */
CKPT_API double ckpt_scheduler_last_lr(const ckpt_scheduler *s, int group);
CKPT_API const ckpt_stateful_ops *ckpt_scheduler_ops(void);

/* ------------------------------------------------------------------------ */
/* Dynamic loss scaling (PyTorch's GradScaler)                               */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_grad_scaler ckpt_grad_scaler;

/* PyTorch's defaults: 65536.0, 2.0, 0.5, 2000. */
CKPT_API int ckpt_grad_scaler_new(ckpt_grad_scaler **out, double init_scale, double growth_factor,
                                  double backoff_factor, int64_t growth_interval);
CKPT_API void ckpt_grad_scaler_free(ckpt_grad_scaler *gs);
/* The current scale; multiply the loss by it before backward. */
CKPT_API double ckpt_grad_scaler_scale(const ckpt_grad_scaler *gs);
/* Divides o's gradients by the scale (once per step) and records whether any
 * is inf or NaN. *found_inf (may be NULL) gets that flag. */
CKPT_API int ckpt_grad_scaler_unscale(ckpt_grad_scaler *gs, ckpt_optimizer *o, bool *found_inf);
/* Unscales if not done yet, then steps o unless an inf/NaN was found.
 * *stepped (may be NULL) says whether it stepped. */
CKPT_API int ckpt_grad_scaler_step(ckpt_grad_scaler *gs, ckpt_optimizer *o, bool *stepped);
/* Backs off or grows the scale from this step's finding; ends the step. */
CKPT_API int ckpt_grad_scaler_update(ckpt_grad_scaler *gs);
CKPT_API const ckpt_stateful_ops *ckpt_grad_scaler_ops(void);

/* ------------------------------------------------------------------------ */
/* Data loading                                                              */
/* ------------------------------------------------------------------------ */

/* A map-style dataset of fixed-size samples. get may be called from prefetch
 * threads at once (num_workers > 0): it must be thread-safe. */
typedef struct ckpt_dataset {
    int64_t (*len)(void *self);
    int (*get)(void *self, int64_t index, void *sample_out); /* writes sample_bytes; 0 or <0 */
    size_t sample_bytes;
    void *self;
    /* Set by ckpt_memory_dataset (its samples and their count); other
     * datasets leave them NULL and 0. */
    const void *mem_data;
    int64_t mem_len;
} ckpt_dataset;

/* Lays out a batch: n samples (their indices and raw sample bytes back to
 * back) into out, which has batch_bytes bytes. NULL: samples back to back. */
typedef int (*ckpt_collate_fn)(void *user, const int64_t *indices, int64_t n,
                               const void *samples, void *out);

typedef struct ckpt_dataloader_config {
    int64_t batch_size;
    bool shuffle;          /* permutation is a pure function of (seed, epoch) */
    uint64_t seed;
    bool drop_last;
    int num_workers;       /* prefetch threads; 0 = load in the caller's thread */
    int prefetch_factor;   /* batches in flight per worker; 0 = 2 */
    int num_processes;     /* shards; 0 or 1 = one process (the accelerator sets it) */
    int process_index;
    bool even_batches;     /* true (default via ckpt_dataloader_defaults): a short last
                              global batch is completed from the epoch's start, so every
                              process gets the same number of samples (several
                              processes only; one process gets a short last batch) */
    ckpt_collate_fn collate;
    void *collate_user;
    size_t batch_bytes;    /* with collate: bytes of a collated batch */
} ckpt_dataloader_config;

/* batch_size 1, no shuffle, seed 0, even_batches true, the rest 0. */
CKPT_API ckpt_dataloader_config ckpt_dataloader_defaults(void);

typedef struct ckpt_batch {
    void *data;             /* size samples, contiguous (or as collate laid them out) */
    int64_t size;           /* samples in this batch (this process's shard) */
    const int64_t *indices; /* their dataset indices */
    int64_t epoch;
    int64_t index;          /* position of this batch in its epoch, from 0 */
    bool end_of_epoch;      /* this is the epoch's last batch */
} ckpt_batch;               /* view valid until the next call on the loader */

typedef struct ckpt_dataloader ckpt_dataloader;

/* Copies *ds and *cfg (the dataset's self is borrowed until free). */
CKPT_API int ckpt_dataloader_new(ckpt_dataloader **out, const ckpt_dataset *ds,
                                 const ckpt_dataloader_config *cfg);
/* Stops the workers and frees; safe at any point of an epoch. */
CKPT_API void ckpt_dataloader_free(ckpt_dataloader *dl);
/* 1: a batch in *b; 0: the epoch ended (the next call starts the next epoch);
 * <0: an error (a failing get names the index). */
CKPT_API int ckpt_dataloader_next(ckpt_dataloader *dl, ckpt_batch *b);
/* Starts epoch `epoch` from its first batch, with one exception that keeps
 * a resumed loop exact: after load_state_dict (ckpt_load_state) restored a
 * position past the first batch of epoch e, and until the loader yields a
 * batch or is repositioned (set_epoch to another epoch, skip, re-shard, another
 * load), set_epoch(e) changes nothing: the next batch is the restored one.
 * (A restored position at the very end of epoch e stays there too: the next
 * call of ckpt_dataloader_next returns 0 and moves to epoch e + 1.) So the
 * usual loop "for each epoch: set_epoch(epoch); while next..." resumes
 * mid-epoch as if it had never stopped. Outside that window, set_epoch of the
 * current epoch restarts it. CKPT_EINVAL for a negative epoch. */
CKPT_API int ckpt_dataloader_set_epoch(ckpt_dataloader *dl, int64_t epoch);
CKPT_API int64_t ckpt_dataloader_epoch(const ckpt_dataloader *dl);
/* Batches (this process's) in one epoch. */
CKPT_API int64_t ckpt_dataloader_num_batches(const ckpt_dataloader *dl);
/* Skips the next num_batches batches of the current epoch without reading a
 * sample; CKPT_EINVAL past the epoch's end. Applies to this epoch only.
 * Porting trap: ckpt_load_state already restores the mid-epoch position
 * (unlike a PyTorch DataLoader, which Accelerate's skip_first_batches has to
 * fast-forward). A skip right after a load that restored a position past the
 * epoch's first batch (before any batch was yielded) still skips, on top of
 * that position, and logs a warning saying so (see ckpt_dataloader_set_log);
 * it would drop those batches from the resumed run. */
CKPT_API int ckpt_skip_first_batches(ckpt_dataloader *dl, int64_t num_batches);
/* State dict: seed, epoch, batches yielded this epoch, dataset length,
 * batch size, shuffle, drop_last, shard. Loading positions the loader at the
 * next batch. */
CKPT_API const ckpt_stateful_ops *ckpt_dataloader_ops(void);

/* ------------------------------------------------------------------------ */
/* In-memory dataset helper                                                  */
/* ------------------------------------------------------------------------ */

/* A dataset over n samples of sample_bytes each, back to back at data
 * (borrowed until the dataset is no longer used). Fills *out, whose self
 * points at *out: a loader made from it uses its own copy, but calling
 * out->get directly needs *out to stay where it is. Allocates nothing. */
CKPT_API int ckpt_memory_dataset(ckpt_dataset *out, const void *data, int64_t n,
                                 size_t sample_bytes);

/* ------------------------------------------------------------------------ */
/* The accelerator: one call to save, one to resume                          */
/* ------------------------------------------------------------------------ */

typedef struct ckpt_accelerator ckpt_accelerator;

/* A named number recorded with a checkpoint (ckpt_set_metric): a validation
 * loss, an accuracy. Names: 1..63 bytes of [A-Za-z0-9_.:/-]. */
#define CKPT_MAX_METRICS 16
typedef struct ckpt_metric {
    char name[64];
    double value;
} ckpt_metric;

/* Which end of a metric is best (retention's best_k). */
typedef enum ckpt_best_mode { CKPT_BEST_MIN = 0, CKPT_BEST_MAX = 1 } ckpt_best_mode;

/* project_dir may be a bucket prefix, "s3://bucket/prefix" (the same keys
 * as a folder; credentials from AWS_*; docs/OBJECT_STORAGE.md): saves
 * stream each file into its object (every rank its own files; in the
 * background thread for ckpt_save_state_async) and commit with the
 * manifest last (If-None-Match: *); loads read the objects by ranged GETs
 * straight into their buffers; one job at a time holds the project's lock
 * object (rank 0 for the job); the logs go to a local folder
 * (ckpt_accelerator_logging_dir). Built without libcurl/OpenSSL, an s3://
 * project_dir fails with CKPT_EUNSUPPORTED saying so. */
typedef struct ckpt_project_config {
    const char *project_dir;          /* checkpoints: <project_dir>/checkpoints/checkpoint_<n> */
    const char *logging_dir;          /* NULL: <project_dir>/logs */
    bool automatic_checkpoint_naming;
    int total_limit;                  /* keep this many valid automatic checkpoints; 0 = all
                                         (the rule of ckpt_checkpoint_prune) */
    int64_t iteration;                /* number of the next automatic checkpoint */
    bool save_on_each_node;           /* multi-node: each node's main process writes (later) */
    int process_index;                /* without comm: this process's index (recorded only) */
    int num_processes;                /* without comm: 0 or 1 = one */
    const ckpt_comm *comm;            /* NULL: one process; else borrowed until free: saves
                                         and loads are collective over it, and
                                         process_index/num_processes come from it */
    int64_t save_interval_steps;      /* ckpt_should_save: every this many steps; 0 = off */
    double save_interval_seconds;     /* ckpt_should_save: once this many seconds passed
                                         since the last save call (or the accelerator's
                                         creation, or the last load); 0 = off */
    /* Retention beyond total_limit (the rule of ckpt_checkpoint_prune_ex;
     * docs/CHECKPOINTS.md "Retention"), applied after each automatic save's
     * commit: */
    int64_t keep_every_steps;         /* also keep every valid checkpoint whose step is a
                                         multiple of this; 0 = off */
    const char *best_metric;          /* with best_k: the metric (ckpt_set_metric) that */
    ckpt_best_mode best_mode;         /* ranks checkpoints, lowest (MIN) or highest best */
    int best_k;                       /* also keep the best_k best; 0 = off */
    /* A model whose tensors exceed this many bytes is saved as Hugging Face
     * shards, <model>-00001-of-0000N.safetensors plus
     * <model>.safetensors.index.json (as Accelerate's save_model and
     * transformers' save_pretrained with max_shard_size), inside the same
     * atomic commit; loads read either layout. 0 = one file. With several
     * processes the shard files are spread over the ranks by bytes (rank 0
     * writes the index). A model with tensors sharded across processes is
     * always one file per process. */
    uint64_t max_shard_size;
    /* With a comm of several processes: how long a save or load waits for
     * the other ranks at each collective before it gives up with
     * CKPT_ETIMEDOUT naming the ranks that did not arrive and the phase.
     * 0 = the default, CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S (10 minutes);
     * negative = wait forever. Needs a comm with deadline support
     * (ckpt_comm_mpi has it; see ckpt_comm.deadline). */
    double collective_timeout_s;
    /* Incremental saves (docs/CHECKPOINTS.md "Incremental saves"): by default
     * a save hashes each state file it is about to write (XXH3-128, in
     * memory) and, when the newest committed checkpoint of the project (or,
     * before the project has one and for a folder given to
     * ckpt_save_state, the checkpoint this accelerator last saved or loaded,
     * a partial load such as a fine-tune's ckpt_load_state_ex of another
     * run's model included) holds a file of that name with the same size and
     * hash, it
     * hard-links that file into the new checkpoint instead of writing it,
     * after checking that the old file still has the bytes its manifest
     * records. Every checkpoint folder stays complete; deleting one never
     * breaks another. Where links cannot be made (another file system, no
     * hard links) the files are written, and a warning says so once per save.
     * A linked file is one physical copy shared by the checkpoints that
     * link it (a bad sector hits each of them; ckpt verify names them);
     * link_copies below keeps more than one copy among the retained ones.
     * true: always write every file (zero-initialised configs keep linking
     * on). */
    bool no_link_unchanged;
    /* Retained checkpoints are independent copies: with linking on, a save
     * keeps at least this many physical copies of every file among the
     * checkpoints retained after it (the new one, and the ones its
     * rotation keeps: the newest total_limit - 1, every one with
     * total_limit 0; an explicit folder's link source), as far as they
     * hold the same bytes. A file whose link would leave fewer is written
     * anew (a copy of its own) instead of linked. 0 = the default, 2: no
     * single bad sector or flipped byte can take every retained checkpoint
     * down with it; with total_limit 0 that costs one extra copy of an
     * unchanged file ever, with total_limit N about one write of it every
     * N - 1 saves (bench/README.md). 1: link whenever the bytes are equal
     * (one copy may serve every checkpoint). Negative: CKPT_EINVAL. */
    int link_copies;
    /* Storage tiers (docs/DISTRIBUTED.md "Storage tiers"). With local_dir
     * set, every automatic save first goes to a node-local folder: each rank
     * writes its part there (a checkpoint folder committed atomically and
     * verified like the project's, numbered with the save's number, with its
     * own retention), then sends it over the communicator to
     * local_replicas other nodes, whose ranks write and verify it in their
     * own local folders. Every persist_every-th save, a save made after a
     * preemption signal was caught (ckpt_preemption_requested) and a save
     * after ckpt_accelerator_persist_next_save also go to the project
     * folder, as without tiers (each rank copies its own part there, rank 0
     * commits). ckpt_load_state(acc, NULL) then resumes from the newest save
     * whose every rank's part is verified somewhere: this rank's node, a
     * replica on another node, or the project folder. Explicit folders
     * (ckpt_save_state(acc, dir)) never use the tiers. */
    /* A folder on the node (a local disk, or /dev/shm: memory, which lasts
     * only as long as the node runs). "%n" expands to the node's index, "%r"
     * to the rank, "%%" to '%'; each rank keeps its files in
     * <local_dir>/rank_<r>. NULL or "": no tier. Needs a project_dir, a local
     * one (over an s3:// project_dir: CKPT_EUNSUPPORTED). */
    const char *local_dir;
    /* How many other nodes keep a copy of each rank's part: rank r's part
     * goes to ranks r + J, r + 2J, ... (mod the process count), J being
     * ranks_per_node, so each copy sits on another node. 0: the default, 1;
     * negative: none (each part only on its own node). At most the number of
     * nodes less one (more is lowered to that, with a warning). */
    int local_replicas;
    /* Every this many saves also goes to the project folder (a save whose
     * number is at least persist_every past the project's newest
     * checkpoint). 0: the default, 1 (every save); negative: CKPT_EINVAL. */
    int persist_every;
    /* Ranks per node, J. 0: the communicator's node split (ranks must then
     * be laid out by node: rank r on node r / J, as mpirun --map-by core
     * and Slurm's block distribution place them). Set it to simulate J-rank
     * nodes on one machine (local_dir must then hold %n or %r). It must
     * divide the process count. */
    int ranks_per_node;
    /* The node-local saves each rank keeps; older ones are removed once a
     * newer one is committed on every node. 0: the default, 1. */
    int local_total_limit;
} ckpt_project_config;

#define CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S 600.0

typedef enum ckpt_log_level {
    CKPT_LOG_INFO = 0,
    CKPT_LOG_WARNING = 1,
    CKPT_LOG_ERROR = 2 /* a background save failed (ckpt_save_state_async) */
} ckpt_log_level;
/* Receives warnings (a fallback to an older checkpoint, a leftover temporary
 * folder removed) and the failure of an asynchronous save the moment it
 * happens. Default: "ckpt: warning: <msg>" / "ckpt: error: <msg>" on stderr.
 * It may be called from the accelerator's background thread (an
 * asynchronous save's failure), so it must be safe to call from a thread
 * other than the one that calls ckpt. */
typedef void (*ckpt_log_fn)(void *user, ckpt_log_level level, const char *msg);

/* Copies *cfg (and its strings). Does not touch the disk.
 * One run per project: with a project_dir, the first ckpt_save_state or
 * ckpt_load_state takes the project lock (flock on
 * <project_dir>/checkpoints/.lock, which records the owner's pid and host)
 * and the accelerator holds it until ckpt_accelerator_free. Another
 * accelerator, in this process or another, is refused at its first save or
 * load with CKPT_EBUSY naming the owner's pid and host. A load takes the lock
 * only if <project_dir>/checkpoints exists. The kernel drops the lock when
 * the owner dies, even by SIGKILL: a stale lock file is no obstacle. */
CKPT_API int ckpt_accelerator_new(ckpt_accelerator **out, const ckpt_project_config *cfg);
/* Releases the project lock, if held, and all the memory below.
 *
 * Memory each call keeps after it returns, beyond the objects' own (docs/
 * CHECKPOINTS.md, "Memory: what each call keeps"; measured on a 384 MiB
 * state by bench/bench_loadmem.c):
 *
 *   call                              keeps                     until
 *   ckpt_accelerator_new, prepare_*   the accelerator, its      free
 *                                     object list (KiB)
 *   ckpt_save_state                   nothing                   -
 *   ckpt_accelerator_prepare_async    the staging area: the     free
 *                                     state's tensor bytes
 *   ckpt_save_state_async             the staging area (the     free
 *                                     first call allocates it
 *                                     if prepare_async did not)
 *   ckpt_load_state / _ex             nothing (the default      -
 *                                     reads through 256 KiB
 *                                     pieces; the loads of the
 *                                     two passes hold a buffer
 *                                     area the size of their
 *                                     files during the call and
 *                                     give it back at its end,
 *                                     or read into the staging
 *                                     area if it exists)
 *   ckpt_save_wait                    nothing                   -
 *   ckpt_accelerator_free             nothing: frees all of it
 */
CKPT_API void ckpt_accelerator_free(ckpt_accelerator *acc);
/* Sets where the accelerator's warnings go (fn NULL: stderr), and those of
 * every data loader and optimizer prepared with it (now or later). Under
 * several processes those objects' warnings, the same on every rank, are
 * reported by the process of index 0 only. */
CKPT_API void ckpt_accelerator_set_log(ckpt_accelerator *acc, ckpt_log_fn fn, void *user);
/* Sets where a data loader's warnings go (fn NULL, the default: "ckpt:
 * warning: <msg>" on stderr). ckpt_prepare_dataloader and a later
 * ckpt_accelerator_set_log replace it with the accelerator's. */
CKPT_API void ckpt_dataloader_set_log(ckpt_dataloader *dl, ckpt_log_fn fn, void *user);
CKPT_API int ckpt_accelerator_process_index(const ckpt_accelerator *acc);
CKPT_API int ckpt_accelerator_num_processes(const ckpt_accelerator *acc);

/* What gets saved. Each borrows the object until the accelerator is freed.
 * The k-th object of a kind is saved as <kind>.safetensors (k = 0) or
 * <kind>_<k>.safetensors. Preparing the same object twice is CKPT_EEXIST. */
CKPT_API int ckpt_prepare_model(ckpt_accelerator *acc, ckpt_model *m);
CKPT_API int ckpt_prepare_optimizer(ckpt_accelerator *acc, ckpt_optimizer *o);
CKPT_API int ckpt_prepare_scheduler(ckpt_accelerator *acc, ckpt_scheduler *s);
/* Also shards the loader for this process (num_processes, process_index). */
CKPT_API int ckpt_prepare_dataloader(ckpt_accelerator *acc, ckpt_dataloader *dl);
CKPT_API int ckpt_prepare_scaler(ckpt_accelerator *acc, ckpt_grad_scaler *gs);
/* Any object with state_dict/load_state_dict: custom_checkpoint_<i>.safetensors
 * in registration order. ops and self are borrowed until the accelerator is
 * freed. CKPT_EINVAL (naming the item) if ops lacks state_dict or
 * load_state_dict; check_state_dict is optional. Without it, a value the
 * object's load_state_dict refuses after its schema matched is found only
 * while ckpt_load_state applies the checkpoint: the objects loaded before it
 * are then already changed (the error says "state partially loaded"). */
CKPT_API int ckpt_register_for_checkpointing(ckpt_accelerator *acc, const ckpt_stateful_ops *ops,
                                             void *self);
/* A custom object under a name of its own: saved as <name>.safetensors,
 * found by that name when loaded (registration order does not matter; the
 * unnamed objects keep their custom_checkpoint_<i> numbering among
 * themselves), selected by it in ckpt_load_options.names, shown by it in
 * `ckpt ls` / `ckpt inspect` and python/ckpt_torch, exported as <name>.pkl
 * (docs/PYTORCH.md). name: 1 to 64 bytes of [A-Za-z0-9_.-], not starting
 * with '.', without ".safetensors" in it, unique among this accelerator's
 * named objects letter case aside (a checkpoint may be copied to a
 * case-insensitive file system), and no name the library's own files take:
 * model, optimizer, scheduler, dataloader, scaler, custom_checkpoint,
 * random_states, alone or followed by _<digits>, nor a name ending in
 * -DDDDD-of-DDDDD (shard files) or in .frozen (a model's frozen file).
 * CKPT_EINVAL naming the rule broken, CKPT_EEXIST for a name or an object
 * registered already; otherwise as ckpt_register_for_checkpointing. */
CKPT_API int ckpt_register_for_checkpointing_named(ckpt_accelerator *acc, const char *name,
                                                   const ckpt_stateful_ops *ops, void *self);

/* The process's default generator, always saved as
 * random_states_<process_index>.safetensors. View valid until free. */
CKPT_API ckpt_rng *ckpt_accelerator_rng(ckpt_accelerator *acc);
/* Seeds the default generator with (seed, process_index). */
CKPT_API int ckpt_set_seed(ckpt_accelerator *acc, uint64_t seed);

/* Saves everything registered. output_dir NULL: the next automatic
 * checkpoint (needs automatic_checkpoint_naming and project_dir; a load with
 * input_dir NULL needs only project_dir, as it reads whatever checkpoints
 * are there). An explicit folder always wins; an existing checkpoint there is
 * replaced atomically, an existing folder that is neither empty nor a
 * checkpoint never is (CKPT_EEXIST, checked again right before the new
 * folder is published). Atomic: on any failure the previous state on disk is
 * intact and nothing partial is visible. Removes the oldest automatic
 * checkpoints beyond total_limit only after the new one is committed (the
 * new one counts as valid without being read again: this save hashed every
 * byte of it). Each removed folder is renamed out of sight before the call
 * returns; its files are deleted by the accelerator's background thread
 * (started for it if no asynchronous save did), which the next save, load,
 * ckpt_save_wait and ckpt_accelerator_free wait for.
 * With a comm of several processes it is collective (every rank calls it
 * with the same arguments): the replicated tensors are spread over the ranks
 * (each writes about 1/P of the state: its part of them, its shards, its
 * random state), rank 0 writes the objects' other entries and commits only
 * once every rank has written and fsynced its own files; every rank returns
 * the same status, and the message of a failure names the rank ("rank 2:
 * ..."). docs/DISTRIBUTED.md.
 *
 * After a failed ckpt_load_state (any failure but CKPT_ENOENT, see there)
 * every save of this accelerator, automatic or explicit, refuses with
 * CKPT_EINVAL quoting the load's error, until a load succeeds or
 * ckpt_accelerator_start_over is called. A run that could not load its
 * checkpoint and carried on from scratch would otherwise rotate the finished
 * run's checkpoints away, or replace its explicit "latest" folder; explicit
 * saves are refused too because such a folder is usually the one the failed
 * load read. */
CKPT_API int ckpt_save_state(ckpt_accelerator *acc, const char *output_dir);
/* Asynchronous save: the same checkpoint as ckpt_save_state(acc, output_dir),
 * with the disk write taken off the caller's thread.
 * In the caller's thread, before it returns: any pending save is ended first
 * (as by ckpt_save_wait; if it failed, its error is returned and nothing else
 * is done), the checkpoint is planned (lock, number, temporary folder: two
 * asynchronous saves never get the same number), the save pre-hooks run
 * (with the temporary folder, as for ckpt_save_state), every object's
 * state_dict runs, and every tensor's bytes are copied into a staging area.
 * From then on the objects may change: what is saved is the state at the
 * call. The background thread (one per accelerator, started by the first
 * call or by ckpt_accelerator_prepare_async or a synchronous save's
 * rotation, joined by ckpt_accelerator_free) then writes and fsyncs
 * the files, commits the checkpoint and applies total_limit, exactly as
 * ckpt_save_state would: same files, same atomicity (a failed or killed save
 * leaves nothing partial and the previous checkpoints intact).
 * Memory: the staging area costs the state's tensor bytes (resident: every
 * page is touched once and stays) from the first call, or from
 * ckpt_accelerator_prepare_async, until the accelerator is freed; it is
 * reused by every later save, grown only when the state grows.
 * ckpt_accelerator_set_async_staging_limit bounds it. Without
 * ckpt_accelerator_prepare_async the first call also allocates it and takes
 * its page faults, and stalls several times longer than the later ones.
 * Errors: a failure of the call itself (bad arguments, lock held, a
 * state_dict failing, out of memory) is returned at once. A failure in the
 * background (ENOSPC, EIO, ...) is sent to the log callback at once (from the
 * background thread, level CKPT_LOG_ERROR) and returned, with its message in
 * ckpt_errmsg() of the waiting thread, by the next ckpt_save_wait,
 * ckpt_save_poll, ckpt_save_state or ckpt_save_state_async; it is returned
 * once.
 * A later ckpt_save_state / ckpt_save_state_async, ckpt_load_state and
 * ckpt_accelerator_free first wait for the pending save (load and free do
 * not return its failure: it stays for the next wait or save; free only
 * logs it). ckpt_accelerator_iteration counts the pending save at once (and
 * goes back if it fails); ckpt_accelerator_last_dir names it once it has
 * been waited for (or committed by ckpt_save_poll). The post-save hooks of a
 * successful asynchronous save run then, in the caller's thread (never in
 * the background).
 * With a comm of several processes it is collective like ckpt_save_state:
 * the background thread only writes this rank's files; the agreement and
 * the commit run in the caller's thread at the next ckpt_save_poll that
 * finds every rank's files written, or the next ckpt_save_wait / save /
 * load / free, which are then collective too, so the communicator's
 * collectives are only ever used from the caller's thread (MPI needs no
 * thread support). With node-local tiers (ckpt_project_config.local_dir)
 * and a comm with exchange_background (ckpt_comm_mpi under
 * MPI_THREAD_MULTIPLE), the background thread also replicates this rank's
 * part to other nodes, over that channel; the commit checks what arrived
 * against the manifest (docs/DISTRIBUTED.md "Storage tiers"). */
CKPT_API int ckpt_save_state_async(ckpt_accelerator *acc, const char *output_dir);
/* Ends the pending asynchronous save: waits for the background thread and
 * returns the save's status (CKPT_OK when none is pending and no failure is
 * waiting to be reported). Also waits for what else the thread has to do:
 * touching the staging area (ckpt_accelerator_prepare_async) and deleting
 * the folders a rotation removed. Collective with several processes. */
CKPT_API int ckpt_save_wait(ckpt_accelerator *acc);
/* Makes a finished asynchronous save durable without waiting for one that
 * is not: never waits for the background thread (nor the disk it writes).
 * If every rank's files of the pending save are written, the save is
 * committed now (with several processes the agreement, rank 0's manifest,
 * rename and folder fsyncs, and total_limit, as at a wait; with one the
 * background thread has committed it already) and its post-save hooks run;
 * otherwise nothing happens. Returns 1 when nothing is pending (the last
 * asynchronous save is committed, or there was none), 0 while the save is
 * still being written, or the failure of the save (a failure is returned
 * once, as by ckpt_save_wait; the save left nothing visible). Collective
 * with several processes, like the other calls: every rank calls it at the
 * same points and gets the same answer (one small reduction). A training
 * loop that saves asynchronously calls it every step or every few, so a
 * save is on disk, committed, as soon as its files are: a job preempted (or
 * killed) before its next save, wait, load or free keeps it. (Without it,
 * with several processes, the commit waits for that next call.) */
CKPT_API int ckpt_save_poll(ckpt_accelerator *acc);
/* How the background thread of asynchronous saves runs its jobs, so that
 * the training loop keeps its core and its disk: CKPT_ASYNC_CPU_IDLE, the
 * scheduler's idle class (SCHED_IDLE: the thread runs only on a core no
 * other thread wants); CKPT_ASYNC_IO_IDLE, the idle I/O class (ioprio_set;
 * honoured by I/O schedulers that have classes). When a caller waits for
 * the job (the next save, a load, ckpt_save_wait, free) the thread goes back
 * to the normal classes at once, so a wait never waits on an idle thread.
 * Default 0: the normal classes throughout. Measured on a 2-vCPU VM shared
 * with other jobs (bench/README.md), CKPT_ASYNC_CPU_IDLE made a run of small
 * asynchronous saves 10-20x slower (the idle thread hardly ran while other
 * processes kept both cores busy) without a measurable gain for the loop,
 * hence opt-in; CKPT_ASYNC_IO_IDLE cost nothing measurable. A class the
 * system refuses is ignored. CKPT_EINVAL for unknown bits. */
#define CKPT_ASYNC_CPU_IDLE 0x1u
#define CKPT_ASYNC_IO_IDLE 0x2u
#define CKPT_ASYNC_IDLE 0x3u
CKPT_API int ckpt_accelerator_set_async_background(ckpt_accelerator *acc, unsigned flags);
/* Prepares the staging area of ckpt_save_state_async now, so that the first
 * asynchronous save stalls no longer than any later one: runs every
 * registered object's state_dict to learn the tensor bytes a save would
 * stage (under the staging limit; nothing is copied or written), allocates
 * the area and starts the background thread, which maps and writes every
 * page of it once (at the idle CPU class of ckpt_accelerator_set_async_
 * background) while the caller goes on; the next save, load, wait or free
 * waits for that first (ckpt_save_wait waits for it too). On a 2-vCPU VM
 * that backs guest memory lazily this took 6 s for 1.49 GB: prepare at
 * start-up, well before the first save.
 * Memory cost: the state's tensor bytes (for a GPT-2-small model with AdamW,
 * 1.49 GB), resident from this call until ckpt_accelerator_free, the same
 * area the first asynchronous save would otherwise allocate. With several
 * processes it is sized for every tensor of the registered objects, more
 * than the part a rank's save plan gives it. Call it after the objects are
 * prepared (again after registering more: it only grows the area).
 * Errors: a state_dict failing (named), out of memory. */
CKPT_API int ckpt_accelerator_prepare_async(ckpt_accelerator *acc);
/* Bounds the staging area of asynchronous saves to bytes (0, the default:
 * no bound). The call then stages whole files in save order while they fit
 * and writes every other file itself, in the caller's thread, before it
 * returns (so a limit below the state's size trades stall for memory). */
CKPT_API int ckpt_accelerator_set_async_staging_limit(ckpt_accelerator *acc, uint64_t bytes);
/* Loads everything registered. input_dir NULL: the newest complete checkpoint
 * that verifies in <project_dir>/checkpoints, falling back (with a warning)
 * to older ones. Everything is checked (manifest, files, every object's
 * schema, then every object's check_state_dict) before anything in memory
 * changes; the files' checksums, on the first load of an accelerator (the
 * resume), as the bytes land in the objects, and on every later load before
 * anything changes (see ckpt_load_options.one_pass and transactional: a
 * damaged newest checkpoint still ends with the next older valid one
 * loaded, but on a first load the objects may hold part of a damaged
 * checkpoint when the load fails). The one other exception: a custom object
 * without check_state_dict whose load_state_dict refuses a value; the
 * objects loaded before it are then already changed and the error says
 * "state partially loaded". Restores the step counter and the automatic
 * numbering.
 * Memory: nothing stays after the call. With one process, plain files and
 * no adapting option (the default), the first load reads each file once
 * straight into the objects' memory, a piece at a time, hashing each piece
 * where it lands (the reads on a second thread); a later load first hashes
 * every file whole through a reused 2 MiB ring, then reads again the same
 * way: a file rewritten in place between the two (by another writer) fails
 * the load with CKPT_ECORRUPT naming the file, "the file changed after it
 * was verified; state partially loaded", and saves refuse as after any
 * failed load. Otherwise (several processes, Hugging Face shards,
 * non_strict, convert_dtypes, prefix_map, rename) each file is read once
 * into a buffer area of private memory, hashed on the way, and the objects
 * load from it; the area (the size of the files this process reads) is
 * given back at the end of the load, unless it is the staging area of
 * asynchronous saves (ckpt_accelerator_prepare_async), which stays.
 * With a comm of several processes it is collective: every rank loads the
 * same checkpoint (a candidate any rank finds corrupt is skipped by all), and
 * nothing is applied on any rank unless every rank's checks pass; every rank
 * returns the same status and message (so every rank's saves are refused or
 * allowed alike after it).
 *
 * CKPT_ENOENT means exactly "there is no checkpoint yet": input_dir NULL and
 * no checkpoint_<n> folder at all in the project. It is the one failure that
 * is a fresh start, and the one that leaves saves allowed. An explicit
 * input_dir that does not exist, is not a folder or is not a checkpoint (no
 * checkpoint.json) is CKPT_EINVAL, naming the path and the checkpoints that
 * do exist beside it (or in the project): a typo such as checkpoint_07 for
 * checkpoint_7 must not read as a fresh start. That and every other
 * failure (a corrupt or partial checkpoint, CKPT_EMISMATCH after a change of
 * configuration, I/O, a hook) makes this accelerator's saves refuse until a
 * load succeeds or the caller calls ckpt_accelerator_start_over (a save into
 * a project another run owns still fails with CKPT_EBUSY first). The resume
 * idiom:
 *     int rc = ckpt_load_state(acc, NULL);
 *     if (rc == CKPT_ENOENT) start from step 0;
 *     else if (rc < 0) stop: print ckpt_errmsg() and exit;
 * An accelerator that never called ckpt_load_state saves freely (automatic
 * numbering continues after the highest existing checkpoint). */
CKPT_API int ckpt_load_state(ckpt_accelerator *acc, const char *input_dir);

/* --- loading part of a checkpoint, and adapting it -------------------------
 * ckpt_load_state_ex is ckpt_load_state with options: load only some of the
 * registered objects (fine-tuning from a pretraining checkpoint loads the
 * model and leaves the fresh optimizer alone), match keys non-strictly,
 * convert F32 / F16 / BF16 tensors, and rename keys. It stays transactional:
 * every selected object is matched, adapted and checked before any of them
 * changes; an object not selected is never touched (not even its
 * state_dict is called). The report says exactly what happened. */

/* Object kinds, for ckpt_load_options.objects. */
#define CKPT_LOAD_MODELS 0x01u
#define CKPT_LOAD_OPTIMIZERS 0x02u
#define CKPT_LOAD_SCHEDULERS 0x04u
#define CKPT_LOAD_DATALOADERS 0x08u
#define CKPT_LOAD_SCALERS 0x10u
#define CKPT_LOAD_CUSTOM 0x20u
#define CKPT_LOAD_RNG 0x40u /* the accelerator's own generator */
#define CKPT_LOAD_ALL 0x7fu

/* A prefix rewrite of file keys: a key that starts with `from` gets `to` in
 * its place ("" as from adds `to` in front of every key; "" as to strips). */
typedef struct ckpt_key_prefix {
    const char *from;
    const char *to;
} ckpt_key_prefix;

/* A renaming hook, called once for every key of every adapted object's file
 * (after the prefix map): object is the object's name ("model", "model_1",
 * "custom_checkpoint_0"), key the file's key. Return 0 to keep key, 1 after
 * writing the new key (NUL-terminated, < cap bytes) into out, or a negative
 * ckpt_status to stop the load (its message, if set, is kept). */
typedef int (*ckpt_key_rename_fn)(void *user, const char *object, const char *key, char *out,
                                  size_t cap);

typedef struct ckpt_load_options {
    /* Which registered objects to load: CKPT_LOAD_* bits, and/or names
     * ("model", "model_1", "optimizer", "custom_checkpoint_2",
     * "random_states"); an object is loaded if its kind's bit is set or its
     * name is listed. Both empty (0 and 0 names): every object. */
    unsigned objects;
    const char *const *names;
    int num_names;
    /* The options below adapt the state dicts of models and custom objects
     * (the keys users name); the optimizer, scheduler, scaler, data loader
     * and generator are always matched exactly (their keys are the
     * library's own). */
    /* Keys in memory and not in the file keep their values ("missing"),
     * keys in the file used by nothing are ignored ("unexpected"); both are
     * listed in the report. A key present on both sides must still match
     * in kind and shape. Sharded tensors cannot be missing (EUNSUPPORTED). */
    bool non_strict;
    /* A tensor whose dtype differs, both of F32, F16, BF16, is converted
     * (ckpt_dtype_convert: round to nearest, ties to even) and listed in the
     * report; any other dtype difference stays CKPT_EMISMATCH. */
    bool convert_dtypes;
    /* Applied in order to every file key; the first entry whose `from` is a
     * prefix rewrites it. Then `rename`, if set. Two file keys that end up
     * with one name are CKPT_EMISMATCH naming both. */
    const ckpt_key_prefix *prefix_map;
    int num_prefix_map;
    ckpt_key_rename_fn rename;
    void *rename_user;
    /* How many times each byte is read (docs/CHECKPOINTS.md, "One pass or
     * two"). By default the accelerator's first load (no save yet, no load
     * applied: the resume) reads each file once, straight into the
     * objects' buffers, each piece hashed as it lands; a checksum mismatch
     * is then found while the objects load, so the objects hold part of
     * that checkpoint: the load of the newest checkpoint (input_dir NULL)
     * warns and loads the next older valid one over them (a strict load
     * rewrites every byte), and otherwise fails with CKPT_ECORRUPT naming
     * the file (and the tensor when it can), saves refusing until a load
     * succeeds. Every later load is transactional: every file is verified
     * whole before anything changes, then read again into the objects.
     * Schemas and check_state_dict always run before anything changes.
     * one_pass: one pass for this load too, even a later one.
     * transactional: two passes for this load too, even the first (both
     * set: CKPT_EINVAL). One pass applies with one process, without the
     * adapting options above, to checkpoints of plain files; elsewhere the
     * load makes its two passes. */
    bool one_pass;
    bool transactional;
} ckpt_load_options;

/* One key the report names. */
typedef struct ckpt_load_key {
    char *object;   /* "model", "custom_checkpoint_0", ... */
    char *key;      /* the key in memory; NULL for an unexpected key */
    char *file_key; /* the key in the file; NULL for a missing key */
    ckpt_dtype file_dtype; /* tensors: the file's dtype / memory's (equal unless converted) */
    ckpt_dtype dtype;
} ckpt_load_key;

typedef struct ckpt_load_report {
    char *dir;       /* the checkpoint folder loaded */
    int64_t step;    /* the checkpoint's step */
    /* Every registered object was loaded: the step counter and the automatic
     * numbering were restored as by ckpt_load_state. A partial load leaves
     * both (and ckpt_accelerator_last_dir) as they were: a fine-tuning run
     * starts at its own step 0 and numbers its own checkpoints. */
    bool full;
    int num_loaded;
    char **loaded;   /* names of the objects loaded */
    int num_skipped;
    char **skipped;  /* names of the registered objects not selected: untouched */
    int64_t num_missing;
    ckpt_load_key *missing;    /* in memory, not in the file: values kept */
    int64_t num_unexpected;
    ckpt_load_key *unexpected; /* in the file, used by nothing */
    int64_t num_renamed;
    ckpt_load_key *renamed;    /* file_key loaded into key */
    int64_t num_converted;
    ckpt_load_key *converted;  /* file_dtype converted to dtype */
} ckpt_load_report;

/* opt NULL: as ckpt_load_state. report may be NULL; if not, it is filled on
 * success (zeroed on failure) and freed with ckpt_load_report_free. Bad
 * options (an unknown bit or name, a NULL prefix entry, a prefix map without
 * entries) are CKPT_EINVAL before anything is read. Otherwise as
 * ckpt_load_state: the same statuses, the same refusal of saves after a
 * failure, collective with several processes (every rank passes the same
 * selection). */
CKPT_API int ckpt_load_state_ex(ckpt_accelerator *acc, const char *input_dir,
                                const ckpt_load_options *opt, ckpt_load_report *report);
CKPT_API void ckpt_load_report_free(ckpt_load_report *report);

/* Loads weights into a model without an accelerator: src is a ckpt
 * checkpoint folder (its model.safetensors, verified against the manifest,
 * in either layout), a folder of Hugging Face / PyTorch weights
 * (model.safetensors, its shards with model.safetensors.index.json,
 * pytorch_model.bin or its shards with an index), or one file (.safetensors
 * or a torch.save'd state dict, read by the allow-list unpickler). The
 * options' non_strict, convert_dtypes, prefix_map and rename apply (the
 * selection fields are ignored); everything is matched and checked before
 * any parameter changes. report (may be NULL) as for ckpt_load_state_ex,
 * with step the checkpoint's (0 for other sources). */
CKPT_API int ckpt_model_load_weights(ckpt_model *m, const char *src, const ckpt_load_options *opt,
                                     ckpt_load_report *report);
/* Converts n elements between F32, F16 and BF16 (either way, or the same
 * dtype: a copy). Narrowing rounds to nearest, ties to even; values beyond
 * the narrower type's range become infinities; NaN stays NaN (quiet, sign
 * kept); F16 subnormals are produced and read exactly. Widening is exact.
 * src and dst must not overlap. CKPT_EINVAL for another dtype. */
CKPT_API int ckpt_dtype_convert(ckpt_dtype from, const void *src, ckpt_dtype to, void *dst,
                                uint64_t n);
/* --- metrics: named numbers recorded with the next save -------------------- */

/* Attaches name = value to the next save (ckpt_save_state or _async; sets or
 * replaces it): the manifest records it (covered by its checksum),
 * `ckpt ls` / `ckpt inspect --json` show it, and best_k retention ranks
 * checkpoints by it. A successful save clears the metrics; a failed
 * synchronous save keeps them for the retry; an asynchronous save takes them
 * at the call. With several processes rank 0's metrics are recorded.
 * CKPT_EINVAL for a bad name (1..63 bytes of [A-Za-z0-9_.:/-]), a NaN or
 * infinite value, or a 17th name. */
CKPT_API int ckpt_set_metric(ckpt_accelerator *acc, const char *name, double value);
/* Forgets the metrics set since the last save. */
CKPT_API void ckpt_clear_metrics(ckpt_accelerator *acc);

/* --- when to save: intervals and preemption ------------------------------ */

/* Whether the loop should save now, at `step` (the step just finished):
 * returns 1 (save), 0 (not yet) or a negative ckpt_status. True when
 *   - a preemption signal was caught (ckpt_preemption_requested), or
 *   - save_interval_steps > 0 and step is a positive multiple of it, or
 *   - save_interval_seconds > 0 and at least that many seconds (monotonic
 *     clock) passed since the last save call, the last successful load or
 *     the accelerator's creation, whichever is latest.
 * With a comm of several processes it is collective (every rank calls it at
 * the same steps) and every rank gets the same answer: true if it is true on
 * any rank (clocks and signals differ between processes), so all ranks save
 * at the same step. It does not save: the caller calls ckpt_save_state (or
 * _async), and, after a preemption, exits. After a preemption it first
 * commits a pending asynchronous save (as ckpt_save_wait, keeping a failure
 * for the next save), so that save is durable before the next one starts.
 * CKPT_EINVAL for step < 0. */
CKPT_API int ckpt_should_save(ckpt_accelerator *acc, int64_t step);

/* Preemption. Schedulers warn before they kill a job (Slurm: SIGTERM, or
 * SIGUSR1 with --signal; Kubernetes: SIGTERM). ckpt_preemption_install
 * installs a handler for each of the n signals (n <= 8; SIGKILL and SIGSTOP
 * cannot be caught: CKPT_EINVAL) that only records the signal in a
 * process-wide flag (async-signal-safe, SA_RESTART, so I/O in progress on any
 * thread, including data-loader prefetch threads, carries on); the loop polls
 * it (ckpt_preemption_requested or ckpt_should_save), saves at a step
 * boundary and exits. Installing again replaces the set (the handlers found
 * first are what uninstall restores). Not thread-safe against concurrent
 * install/uninstall calls; call them from the main thread. */
CKPT_API int ckpt_preemption_install(const int *signals, int n);
/* Restores the handlers found at install and clears the flag. */
CKPT_API void ckpt_preemption_uninstall(void);
/* Whether one of the installed signals arrived since install (or the last
 * ckpt_preemption_clear). Safe to call from any thread. */
CKPT_API bool ckpt_preemption_requested(void);
/* The first signal caught (e.g. SIGTERM), 0 if none. */
CKPT_API int ckpt_preemption_signal(void);
/* Forgets a caught signal (handlers stay installed). */
CKPT_API void ckpt_preemption_clear(void);

/* Says explicitly that this run starts over although its last
 * ckpt_load_state failed: saves are allowed again (automatic numbering
 * continues after the highest existing checkpoint, and total_limit rotation
 * may then remove the old run's checkpoints). Changes nothing in memory.
 * CKPT_EINVAL if acc is NULL. */
CKPT_API int ckpt_accelerator_start_over(ckpt_accelerator *acc);
/* What this process's last completed save did with its state files
 * (incremental saves, ckpt_project_config.no_link_unchanged): *written gets
 * the bytes of the files it wrote, *linked those of the files it linked from
 * the previous checkpoint instead (either may be NULL; 0 before any save).
 * With several processes, each its own files. */
CKPT_API void ckpt_accelerator_last_save_bytes(const ckpt_accelerator *acc, uint64_t *written,
                                               uint64_t *linked);
/* The folder of the last save or load; "" if none. View valid until the next
 * save/load or free. After a save or load of a node-local tier
 * (ckpt_project_config.local_dir) that was not in the project folder, this
 * rank's folder of it on its node (<local_dir>/rank_<r>/checkpoint_<n>). */
CKPT_API const char *ckpt_accelerator_last_dir(const ckpt_accelerator *acc);
/* The folder for the run's logs: the config's logging_dir, else
 * <project_dir>/logs; with a project in object storage (s3://), the logs
 * folder of its local staging folder (docs/OBJECT_STORAGE.md). "" if none. */
CKPT_API const char *ckpt_accelerator_logging_dir(const ckpt_accelerator *acc);
/* With a node-local tier (ckpt_project_config.local_dir): the next automatic
 * save also goes to the project folder, whatever persist_every says (a
 * run's final save). With several processes rank 0's call decides; call it
 * on every rank alike. Without a tier every save goes there anyway. */
CKPT_API int ckpt_accelerator_persist_next_save(ckpt_accelerator *acc);

/* The step: what a save records in its manifest and a full load restores
 * (the training step to resume at). It follows the optimizer: unless
 * ckpt_accelerator_set_step was called, it is the step count of the first
 * prepared optimizer (ckpt_optimizer_get_step: its number of updates, as
 * PyTorch's state[p]["step"]), so a loop that never sets it saves and
 * resumes at the right step; without a prepared optimizer, 0 until set or
 * loaded. Once set, it is what was set (a loop that counts steps the
 * optimizer does not, e.g. with gradient accumulation or a loss scaler
 * that skips steps). The first save whose explicitly set step differs from
 * the first prepared optimizer's count logs a warning saying both (once
 * per accelerator); the checkpoint records the step set. A full load
 * restores the checkpoint's step: from then on it follows the optimizer
 * again if the two agree, else it stays as loaded until set. */
CKPT_API int64_t ckpt_accelerator_step(const ckpt_accelerator *acc);
CKPT_API void ckpt_accelerator_set_step(ckpt_accelerator *acc, int64_t step);
/* The number the next automatic checkpoint will get. */
CKPT_API int64_t ckpt_accelerator_iteration(const ckpt_accelerator *acc);

/* Hooks, as Accelerate's register_save_state_pre_hook /
 * register_load_state_pre_hook, plus post hooks. Each kind runs in
 * registration order; dir is a view valid during the call.
 *
 * Save pre-hook: called during every save, before the state files are
 * written, with the TEMPORARY folder being written (it exists; it is
 * hidden, ".<name>.tmp.<pid>" beside the final folder). Regular files the
 * hook creates at the top of that folder become part of the checkpoint:
 * listed in the manifest as kind "extra" with their size and XXH3-64,
 * fsynced, published atomically with the rest, verified by
 * ckpt_checkpoint_verify and ckpt_load_state (an extra file changed later
 * makes the checkpoint corrupt), shown by ckpt_checkpoint_files and `ckpt
 * inspect`. A name must be visible (no leading '.'), not checkpoint.json and
 * not one of the state files' names; a subfolder, a symbolic link or any
 * other entry fails the save with CKPT_EINVAL naming it (nothing is
 * published). Write files the hook wants kept with the checkpoint there, and
 * nothing else.
 * Load pre-hook: called before the load's objects are checked, with the
 * folder being loaded (already verified).
 * A pre-hook's non-zero return aborts the save/load with that code (a value
 * that is not a ckpt_status becomes CKPT_EINVAL) and the message it set with
 * ckpt_set_error ("... returned CKPT_X" if none).
 *
 * Save post-hook: called after the checkpoint is committed (and any
 * total_limit rotation), with the final folder. Load post-hook: called after
 * a successful load, with the folder loaded. The save or load has succeeded
 * by then and stays successful: a post-hook's non-zero return is logged as a
 * warning (with its message) and the remaining post-hooks still run.
 *
 * With several processes every hook runs on every rank, with the same folder;
 * one rank's pre-hook failure fails all. The files save pre-hooks of any rank
 * leave in the temporary folder are listed by rank 0 when it commits. */
typedef int (*ckpt_state_hook_fn)(void *user, ckpt_accelerator *acc, const char *dir);
typedef struct ckpt_hook_handle ckpt_hook_handle;
/* *handle (may be NULL) receives a handle whose removal stops the hook. */
CKPT_API int ckpt_register_save_state_pre_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn,
                                               void *user, ckpt_hook_handle **handle);
CKPT_API int ckpt_register_load_state_pre_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn,
                                               void *user, ckpt_hook_handle **handle);
CKPT_API int ckpt_register_save_state_post_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn,
                                                void *user, ckpt_hook_handle **handle);
CKPT_API int ckpt_register_load_state_post_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn,
                                                void *user, ckpt_hook_handle **handle);
/* Removes the hook and frees the handle. NULL is a no-op. Handles left are
 * freed with the accelerator. */
CKPT_API void ckpt_hook_remove(ckpt_hook_handle *handle);

#ifdef __cplusplus
}
#endif

/* The specialised parts, each in a header of its own that includes this one:
 * #include <ckpt.h> gives them all, as before. */
#include "ckpt/comm.h"  /* communicators: the process group a save spans */
#include "ckpt/files.h" /* state-dict files and checkpoint folders, for tools */
#include "ckpt/torch.h" /* PyTorch files and the PyTorch / Hugging Face bridge */

#endif /* CKPT_H */
