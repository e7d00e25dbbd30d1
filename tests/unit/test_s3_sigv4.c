/* test_s3_sigv4.c — the object-store client's pure parts: Signature V4
 * against worked examples, the URI encoding it signs, and s3:// URLs.
 *
 * The expected values were computed here, independently of this code, by
 * the SigV4 procedure written out in Python's hmac and hashlib. The first
 * three requests are the worked examples of AWS's S3 documentation ("Signature
 * Calculations for the Authorization Header: Transferring Payload in a Single
 * Chunk", example credentials AKIAIOSFODNN7EXAMPLE), given only as a
 * reference for the inputs; the fourth is ours (path-style, a session token,
 * If-None-Match, UNSIGNED-PAYLOAD, another region). The XML answers' text
 * is read with its entities decoded (an ETag comes as &quot;...&quot;). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "store/s3/s3.h"
#ifdef CKPT_HAVE_S3
#include "store/s3/s3_int.h"
#endif

static const ckpt_s3_creds aws_example = {
    "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", NULL, "us-east-1"};

static int need_s3(void **state) {
    (void)state;
    if (ckpt__s3_available("test") < 0) {
        print_message("built without libcurl/OpenSSL: %s\n", ckpt_errmsg());
        return -1;
    }
    return 0;
}

static void test_sigv4_get_object_with_range(void **state) {
    (void)state;
    if (need_s3(state) < 0) skip();
    ckpt_s3_hdr h[] = {{"host", "examplebucket.s3.amazonaws.com"},
                       {"range", "bytes=0-9"},
                       {"x-amz-content-sha256", CKPT_SHA256_EMPTY},
                       {"x-amz-date", "20130524T000000Z"}};
    char *creq = NULL, *sts = NULL, *auth = NULL;
    assert_int_equal(ckpt__sigv4(&aws_example, "GET", "/test.txt", "", h, 4, CKPT_SHA256_EMPTY,
                                 "20130524T000000Z", &creq, &sts, &auth),
                     0);
    assert_string_equal(creq, "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\n"
                              "range:bytes=0-9\n"
                              "x-amz-content-sha256:" CKPT_SHA256_EMPTY "\n"
                              "x-amz-date:20130524T000000Z\n\n"
                              "host;range;x-amz-content-sha256;x-amz-date\n" CKPT_SHA256_EMPTY);
    assert_string_equal(sts, "AWS4-HMAC-SHA256\n20130524T000000Z\n"
                             "20130524/us-east-1/s3/aws4_request\n"
                             "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972");
    assert_string_equal(auth, "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/"
                              "us-east-1/s3/aws4_request, "
                              "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
                              "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6"
                              "036bdb41");
    free(creq);
    free(sts);
    free(auth);
}

static void test_sigv4_put_object_signed_payload(void **state) {
    if (need_s3(state) < 0) skip();
    const char *body = "Welcome to Amazon S3.";
    char ph[65];
    ckpt__sha256_hex(body, strlen(body), ph);
    assert_string_equal(ph, "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
    char *uri = ckpt__s3_uri_encode("/test$file.text", true);
    assert_string_equal(uri, "/test%24file.text");
    /* headers in no particular order, one with blanks to be trimmed */
    ckpt_s3_hdr h[] = {{"x-amz-storage-class", "  REDUCED_REDUNDANCY "},
                       {"host", "examplebucket.s3.amazonaws.com"},
                       {"x-amz-date", "20130524T000000Z"},
                       {"date", "Fri, 24 May 2013 00:00:00 GMT"},
                       {"x-amz-content-sha256", ph}};
    char *auth = NULL;
    assert_int_equal(
        ckpt__sigv4(&aws_example, "PUT", uri, "", h, 5, ph, "20130524T000000Z", NULL, NULL, &auth),
        0);
    assert_non_null(strstr(auth, "SignedHeaders=date;host;x-amz-content-sha256;x-amz-date;"
                                 "x-amz-storage-class, "));
    assert_non_null(
        strstr(auth, "Signature=98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd"));
    free(uri);
    free(auth);
}

static void test_sigv4_list_with_query(void **state) {
    if (need_s3(state) < 0) skip();
    ckpt_s3_hdr h[] = {{"host", "examplebucket.s3.amazonaws.com"},
                       {"x-amz-content-sha256", CKPT_SHA256_EMPTY},
                       {"x-amz-date", "20130524T000000Z"}};
    char *auth = NULL;
    assert_int_equal(ckpt__sigv4(&aws_example, "GET", "/", "max-keys=2&prefix=J", h, 3,
                                 CKPT_SHA256_EMPTY, "20130524T000000Z", NULL, NULL, &auth),
                     0);
    assert_non_null(
        strstr(auth, "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"));
    free(auth);
}

static void test_sigv4_path_style_token_conditional(void **state) {
    if (need_s3(state) < 0) skip();
    ckpt_s3_creds cr = {"AK", "SK", "tok/en+1=", "eu-west-3"};
    ckpt_s3_hdr h[] = {{"host", "127.0.0.1:9000"},
                       {"if-none-match", "*"},
                       {"x-amz-content-sha256", "UNSIGNED-PAYLOAD"},
                       {"x-amz-date", "20260102T030405Z"},
                       {"x-amz-security-token", "tok/en+1="}};
    char *auth = NULL;
    assert_int_equal(ckpt__sigv4(&cr, "PUT", "/bucket/run/checkpoints/checkpoint_3/checkpoint.json",
                                 "", h, 5, "UNSIGNED-PAYLOAD", "20260102T030405Z", NULL, NULL,
                                 &auth),
                     0);
    assert_string_equal(auth, "AWS4-HMAC-SHA256 Credential=AK/20260102/eu-west-3/s3/aws4_request, "
                              "SignedHeaders=host;if-none-match;x-amz-content-sha256;x-amz-date;"
                              "x-amz-security-token, "
                              "Signature=48c31ee406f444867a07f42bb8348758f88ad464b730c3ac3076e597"
                              "2d0d5a41");
    free(auth);
    /* a date that is not YYYYMMDDTHHMMSSZ is refused */
    assert_int_equal(
        ckpt__sigv4(&cr, "PUT", "/", "", h, 5, "UNSIGNED-PAYLOAD", "2026-01-02", NULL, NULL, &auth),
        CKPT_EINVAL);
    assert_null(auth);
}

static void test_uri_encode(void **state) {
    (void)state;
    char *e = ckpt__s3_uri_encode("a b/c~d_e-f.g+h=i&\x01\xff", false);
    assert_string_equal(e, "a%20b%2Fc~d_e-f.g%2Bh%3Di%26%01%FF");
    free(e);
    e = ckpt__s3_uri_encode("run 1/checkpoints/checkpoint_2/model.safetensors", true);
    assert_string_equal(e, "run%201/checkpoints/checkpoint_2/model.safetensors");
    free(e);
}

static void test_parse_url(void **state) {
    (void)state;
    char *b = NULL, *p = NULL;
    assert_int_equal(ckpt__s3_parse_url("s3://my-bucket/runs/a//", &b, &p), 0);
    assert_string_equal(b, "my-bucket");
    assert_string_equal(p, "runs/a");
    free(b);
    free(p);
    assert_int_equal(ckpt__s3_parse_url("s3://my-bucket", &b, &p), 0);
    assert_string_equal(p, "");
    free(b);
    free(p);
    const char *bad[] = {"s3://",           "s3://ab",           "s3://a b/x", "s3://bucket/../x",
                         "s3://bucket/./x", "s3://bucket/a\x01", "file:///x",  "s3://bucket//x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(ckpt__s3_parse_url(bad[i], &b, &p), CKPT_EINVAL);
        assert_null(b);
        assert_null(p);
    }
    assert_true(ckpt__s3_is_url("s3://x"));
    assert_false(ckpt__s3_is_url("S3://x"));
    assert_false(ckpt__s3_is_url("run/s3://x"));
}

static void test_xml_text(void **state) {
    (void)state;
#ifdef CKPT_HAVE_S3
    const char *x =
        "<R><Key>a&amp;b&lt;c&gt;&apos;&#65;&#x42;</Key>"
        "<ETag>&quot;c2a7efff115d977e3306da7133164da0&quot;</ETag><Bad>&nope;</Bad></R>";
    char out[128];
    assert_int_equal(ckpt__s3_xml_text(x, strlen(x), "Key", out, sizeof out), 0);
    assert_string_equal(out, "a&b<c>'AB");
    assert_int_equal(ckpt__s3_xml_text(x, strlen(x), "ETag", out, sizeof out), 0);
    assert_string_equal(out, "\"c2a7efff115d977e3306da7133164da0\"");
    assert_int_equal(ckpt__s3_xml_text(x, strlen(x), "Bad", out, sizeof out), -1);
    assert_int_equal(ckpt__s3_xml_text(x, strlen(x), "Missing", out, sizeof out), -1);
    assert_int_equal(ckpt__s3_xml_text(x, strlen(x), "ETag", out, 10), -1); /* does not fit */
#endif
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigv4_get_object_with_range),
        cmocka_unit_test(test_sigv4_put_object_signed_payload),
        cmocka_unit_test(test_sigv4_list_with_query),
        cmocka_unit_test(test_sigv4_path_style_token_conditional),
        cmocka_unit_test(test_uri_encode),
        cmocka_unit_test(test_parse_url),
        cmocka_unit_test(test_xml_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
