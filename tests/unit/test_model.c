/* test_model.c — parameter registration, key rules, and the model's state
 * dict: exactly the parameters, under their names, loaded back in place. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "helpers/testutil.h"

static void test_add_param_records_name_shape_and_buffers(void **state) {
    (void)state;
    float w[6], gw[6];
    int64_t b[3];
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    int64_t sw[2] = {2, 3}, sb[1] = {3};
    char name[16] = "layer.w";
    assert_int_equal(ckpt_model_add_param(m, name, CKPT_F32, 2, sw, w, gw), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "layer.b", CKPT_I64, 1, sb, b, NULL), CKPT_OK);
    double scalar = 1;
    assert_int_equal(ckpt_model_add_param(m, "scalar", CKPT_F64, 0, NULL, &scalar, NULL), CKPT_OK);
    strcpy(name, "changed"); /* the model copied the name */
    sw[0] = 99;             /* and the shape */
    assert_int_equal(ckpt_model_num_params(m), 3);
    assert_int_equal(ckpt_model_num_elements(m), 6 + 3 + 1);
    ckpt_param_info info;
    assert_int_equal(ckpt_model_param(m, 0, &info), CKPT_OK);
    assert_string_equal(info.name, "layer.w");
    assert_int_equal(info.dtype, CKPT_F32);
    assert_int_equal(info.ndim, 2);
    assert_int_equal(info.shape[0], 2);
    assert_int_equal(info.shape[1], 3);
    assert_int_equal(info.numel, 6);
    assert_ptr_equal(info.data, w);
    assert_ptr_equal(info.grad, gw);
    assert_int_equal(ckpt_model_param(m, 1, &info), CKPT_OK);
    assert_null(info.grad);
    assert_int_equal(ckpt_model_param(m, 3, &info), CKPT_EINVAL);
    assert_int_equal(ckpt_model_param(m, -1, &info), CKPT_EINVAL);
    ckpt_model_free(m);
    ckpt_model_free(NULL);
}

static void test_add_param_rejects_bad_names_and_duplicates(void **state) {
    (void)state;
    float x[2];
    int64_t s[1] = {2};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "a", CKPT_F32, 1, s, x, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "a", CKPT_F32, 1, s, x, NULL), CKPT_EEXIST);
    tu_assert_errmsg_has("'a'");
    assert_int_equal(ckpt_model_add_param(m, "", CKPT_F32, 1, s, x, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, NULL, CKPT_F32, 1, s, x, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, "__metadata__", CKPT_F32, 1, s, x, NULL),
                     CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, "tab\there", CKPT_F32, 1, s, x, NULL), CKPT_EINVAL);
    char *longname = malloc(CKPT_MAX_KEY + 2);
    memset(longname, 'k', CKPT_MAX_KEY + 1);
    longname[CKPT_MAX_KEY + 1] = '\0';
    assert_int_equal(ckpt_model_add_param(m, longname, CKPT_F32, 1, s, x, NULL), CKPT_EINVAL);
    longname[CKPT_MAX_KEY] = '\0'; /* exactly the limit is fine */
    assert_int_equal(ckpt_model_add_param(m, longname, CKPT_F32, 1, s, x, NULL), CKPT_OK);
    free(longname);
    int64_t neg[1] = {-1};
    assert_int_equal(ckpt_model_add_param(m, "neg", CKPT_F32, 1, neg, x, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, "nodata", CKPT_F32, 1, s, NULL, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, "ndim", CKPT_F32, CKPT_MAX_NDIM + 1, s, x, NULL),
                     CKPT_EINVAL);
    assert_int_equal(ckpt_model_add_param(m, "dtype", CKPT_DTYPE_INVALID, 1, s, x, NULL),
                     CKPT_EINVAL);
    assert_int_equal(ckpt_model_num_params(m), 2);
    ckpt_model_free(m);
}

static void test_add_param_allocation_failures_are_clean(void **state) {
    (void)state;
    float x[2];
    int64_t s[1] = {2};
    for (uint64_t n = 1;; n++) {
        ckpt_model *m = NULL;
        ckpt__alloc_fail_after(n);
        int rc = ckpt_model_new(&m);
        char name[32];
        for (int i = 0; rc == CKPT_OK && i < 40; i++) {
            snprintf(name, sizeof name, "p%d", i);
            rc = ckpt_model_add_param(m, name, CKPT_F32, 1, s, x, NULL);
        }
        ckpt__alloc_fail_after(0);
        if (rc == CKPT_OK) {
            assert_int_equal(ckpt_model_num_params(m), 40);
            ckpt_model_free(m);
            break;
        }
        assert_int_equal(rc, CKPT_ENOMEM);
        ckpt_model_free(m);
    }
}

static void test_state_dict_is_exactly_the_parameters(void **state) {
    (void)state;
    float w[6] = {1, 2, 3, 4, 5, 6};
    uint16_t h[4] = {1, 2, 3, 4};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    int64_t sw[2] = {3, 2}, sh[1] = {4};
    assert_int_equal(ckpt_model_add_param(m, "enc.weight", CKPT_F32, 2, sw, w, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "enc.bias", CKPT_BF16, 1, sh, h, NULL), CKPT_OK);
    ckpt_writer *w_;
    assert_int_equal(ckpt_writer_new(&w_), CKPT_OK);
    assert_int_equal(ckpt_model_ops()->state_dict(m, w_), CKPT_OK);
    assert_int_equal(ckpt_writer_entry_count(w_), 2);
    ckpt_entry_info e;
    assert_int_equal(ckpt_writer_entry(w_, 0, &e), CKPT_OK);
    assert_string_equal(e.key, "enc.weight");
    assert_int_equal(e.kind, CKPT_ENTRY_TENSOR);
    assert_int_equal(e.dtype, CKPT_F32);
    assert_int_equal(e.ndim, 2);
    assert_int_equal(e.shape[0], 3);
    assert_int_equal(e.shape[1], 2);
    assert_int_equal(ckpt_writer_entry(w_, 1, &e), CKPT_OK);
    assert_string_equal(e.key, "enc.bias");
    assert_int_equal(e.dtype, CKPT_BF16);
    ckpt_writer_free(w_);
    ckpt_model_free(m);
}

static void test_load_state_dict_restores_every_parameter(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "model.safetensors");
    float w[6] = {1.5f, -2, 3, 4, 5, 6.25f}, w2[6] = {0};
    int64_t b[2] = {INT64_MIN, 7}, b2[2] = {0};
    int64_t sw[2] = {2, 3}, sb[1] = {2};
    ckpt_model *a, *c;
    assert_int_equal(ckpt_model_new(&a), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(a, "w", CKPT_F32, 2, sw, w, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(a, "b", CKPT_I64, 1, sb, b, NULL), CKPT_OK);
    tu_save_state(ckpt_model_ops(), a, path);
    /* a model with the same parameters, registered in another order */
    assert_int_equal(ckpt_model_new(&c), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(c, "b", CKPT_I64, 1, sb, b2, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(c, "w", CKPT_F32, 2, sw, w2, NULL), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), c, path), CKPT_OK);
    assert_memory_equal(w, w2, sizeof w);
    assert_memory_equal(b, b2, sizeof b);
    ckpt_model_free(a);
    ckpt_model_free(c);
}

/* The file the load tests read: a model of v = {7, 8} (shape [2]) and
 * w = {1, ..., 6} (shape [2,3]). */
static const float saved_v[2] = {7, 8}, saved_w[6] = {1, 2, 3, 4, 5, 6};

static void save_v_and_w(const char *path) {
    float w[6], v[2];
    memcpy(w, saved_w, sizeof w);
    memcpy(v, saved_v, sizeof v);
    int64_t s23[2] = {2, 3}, s2[1] = {2};
    ckpt_model *a;
    assert_int_equal(ckpt_model_new(&a), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(a, "v", CKPT_F32, 1, s2, v, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(a, "w", CKPT_F32, 2, s23, w, NULL), CKPT_OK);
    tu_save_state(ckpt_model_ops(), a, path);
    ckpt_model_free(a);
}

static void test_load_rejects_shape_mismatch_missing_and_extra_and_changes_nothing(void **state) {
    (void)state;
    char path[128];
    save_v_and_w(tu_path(path, sizeof path, tu_dir(), "model.safetensors"));
    int64_t s2[1] = {2}, s32[2] = {3, 2};

    float x[6] = {9, 9, 9, 9, 9, 9}, y[2] = {9, 9};
    const float nines[6] = {9, 9, 9, 9, 9, 9};
    ckpt_model *m;
    /* v loads fine but w has another shape: v must stay untouched too */
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "v", CKPT_F32, 1, s2, y, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "w", CKPT_F32, 2, s32, x, NULL), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), m, path), CKPT_EMISMATCH);
    tu_assert_errmsg_has("'w'");
    tu_assert_errmsg_has("[2,3] in file");
    assert_memory_equal(x, nines, sizeof x);
    assert_memory_equal(y, nines, sizeof y);
    ckpt_model_free(m);
    /* a parameter the file lacks */
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "v", CKPT_F32, 1, s2, y, NULL), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "u", CKPT_F32, 1, s2, x, NULL), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), m, path), CKPT_EMISMATCH);
    tu_assert_errmsg_has("'u'");
    assert_memory_equal(y, nines, sizeof y);
    ckpt_model_free(m);
    /* the file has a tensor the model lacks */
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "v", CKPT_F32, 1, s2, y, NULL), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), m, path), CKPT_EMISMATCH);
    tu_assert_errmsg_has("'w'");
    assert_memory_equal(y, nines, sizeof y);
    ckpt_model_free(m);
}

/* check_state_dict refuses exactly what load_state_dict refuses (a missing
 * parameter, another dtype or shape, an extra entry), with the same code and
 * message, and never writes a parameter, not even for a good file. */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_model_ops();
    assert_non_null(ops->check_state_dict);
    char path[128];
    save_v_and_w(tu_path(path, sizeof path, tu_dir(), "model.safetensors"));
    int64_t s23[2] = {2, 3}, s2[1] = {2}, s32[2] = {3, 2};
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);

    static const struct {
        const char *name2;  /* second parameter's name; NULL: none */
        ckpt_dtype dt2;
        int shape2;         /* 0: [2,3], 1: [3,2] */
        int code;
        const char *needle;
    } cases[] = {
        {"w", CKPT_F32, 1, CKPT_EMISMATCH, "model: parameter 'w': F32 [2,3] in file, F32 [3,2] in memory"},
        {"w", CKPT_I32, 0, CKPT_EMISMATCH, "model: parameter 'w': F32 [2,3] in file, I32 [2,3] in memory"},
        {"u", CKPT_F32, 0, CKPT_EMISMATCH, "model: parameter 'u' missing from the state dict"},
        {NULL, CKPT_F32, 0, CKPT_EMISMATCH, "model: state dict has entry 'w', which is no parameter"},
        {"w", CKPT_F32, 0, CKPT_OK, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float x[6] = {9, 9, 9, 9, 9, 9}, y[2] = {9, 9};
        const float nines[6] = {9, 9, 9, 9, 9, 9};
        ckpt_model *m;
        assert_int_equal(ckpt_model_new(&m), CKPT_OK);
        assert_int_equal(ckpt_model_add_param(m, "v", CKPT_F32, 1, s2, y, NULL), CKPT_OK);
        if (cases[i].name2)
            assert_int_equal(ckpt_model_add_param(m, cases[i].name2, cases[i].dt2, 2,
                                                  cases[i].shape2 ? s32 : s23, x, NULL),
                             CKPT_OK);
        char msg[256];
        tu_check_state(ops, m, r, cases[i].code, cases[i].needle, i, msg, sizeof msg);
        assert_memory_equal(x, nines, sizeof x);
        assert_memory_equal(y, nines, sizeof y);
        tu_load_state_like_check(ops, m, r, cases[i].code, msg);
        if (cases[i].code != CKPT_OK) {
            assert_memory_equal(x, nines, sizeof x);
            assert_memory_equal(y, nines, sizeof y);
        } else {
            assert_memory_equal(x, saved_w, sizeof x);
            assert_memory_equal(y, saved_v, sizeof y);
        }
        ckpt_model_free(m);
    }
    ckpt_reader_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add_param_records_name_shape_and_buffers),
        cmocka_unit_test(test_add_param_rejects_bad_names_and_duplicates),
        cmocka_unit_test(test_add_param_allocation_failures_are_clean),
        cmocka_unit_test(test_state_dict_is_exactly_the_parameters),
        cmocka_unit_test_setup_teardown(test_load_state_dict_restores_every_parameter, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_load_rejects_shape_mismatch_missing_and_extra_and_changes_nothing, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_check_state_dict_refuses_what_load_refuses_and_changes_nothing, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
