/*
 * A stand-in for libcupti, for the CPU tests of the agent's CUPTI front end (gpuos_trace.c
 * built with -DGPUOS_AGENT): it keeps the subscriber's callback, and a test delivers callbacks
 * through it (fake_cupti_deliver) with the structs the real CUPTI passes.
 */
#include <stdint.h>

typedef void (*cupti_cb_t)(void *, int, uint32_t, const void *);
static cupti_cb_t callback;
static void *userdata;
static int enabled;

int cuptiSubscribe(void **subscriber, cupti_cb_t cb, void *ud) {
    if (callback) return 39; /* CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED */
    callback = cb;
    userdata = ud;
    *subscriber = (void *)&callback;
    return 0;
}

int cuptiEnableCallback(uint32_t enable, void *subscriber, int domain, uint32_t cbid) {
    (void)subscriber; (void)domain; (void)cbid;
    enabled += enable ? 1 : -1;
    return 0;
}

int cuptiUnsubscribe(void *subscriber) {
    (void)subscriber;
    callback = 0;
    return 0;
}

/* for the tests: one callback, as CUPTI would make it; 0 when none is subscribed */
int fake_cupti_deliver(int domain, uint32_t cbid, const void *data) {
    if (!callback) return 0;
    callback(userdata, domain, cbid, data);
    return 1;
}

int fake_cupti_enabled(void) { return enabled; }
