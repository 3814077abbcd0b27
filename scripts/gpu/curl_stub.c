/* Stand-in libcurl.so.4 for Mooncake's engine.so on a host without libcurl:
 * the engine links libcurl only for its HTTP metadata server, which
 * P2PHANDSHAKE (kvconn's mode) never uses. Every call fails cleanly. */
#include <stddef.h>
int curl_global_init(long flags) { (void)flags; return 0; }
void *curl_easy_init(void) { return NULL; }
int curl_easy_setopt(void *h, int opt, ...) { (void)h; (void)opt; return 1; }
int curl_easy_perform(void *h) { (void)h; return 1; }
int curl_easy_getinfo(void *h, int info, ...) { (void)h; (void)info; return 1; }
void curl_easy_reset(void *h) { (void)h; }
void curl_easy_cleanup(void *h) { (void)h; }
const char *curl_easy_strerror(int code) { (void)code; return "libcurl stub (kvconn gpu-check): no HTTP"; }
char *curl_easy_escape(void *h, const char *s, int n) { (void)h; (void)s; (void)n; return NULL; }
void curl_free(void *p) { (void)p; }
void *curl_slist_append(void *l, const char *s) { (void)s; return l; }
void curl_slist_free_all(void *l) { (void)l; }
