/* Preloaded in front of Debian 12's libfaketime (0.9.10) by tests/faketime.py.
 *
 * That libfaketime, told to leave the monotonic clock alone
 * (FAKETIME_DONT_FAKE_MONOTONIC=1, as a wall-clock step would), still
 * shifts an absolute CLOCK_MONOTONIC deadline given to clock_nanosleep() by
 * the faked wall-clock time, and the call fails with EINVAL: Python's
 * time.sleep() is such a call (upstream fixed it after 0.9.10, issue 426).
 * The monotonic clock is real here, so its sleeps go straight to the C
 * library; sleeps on every other clock still go through libfaketime.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <time.h>

typedef int (*sleep_fn)(clockid_t, int, const struct timespec *, struct timespec *);

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *request,
                    struct timespec *remain)
{
    static sleep_fn libc_sleep, next_sleep;
    if (libc_sleep == NULL) {
        next_sleep = (sleep_fn)dlsym(RTLD_NEXT, "clock_nanosleep");
        libc_sleep = (sleep_fn)dlsym(dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD),
                                     "clock_nanosleep");
    }
    return (clock_id == CLOCK_MONOTONIC ? libc_sleep : next_sleep)(clock_id, flags, request,
                                                                   remain);
}
