// Native frames on a fatal signal, for the Python module. Python's faulthandler prints only the
// Python frames of a crash inside the extension; with STRATA_NATIVE_BACKTRACE=1 in the
// environment, importing strata._strata installs handlers for SIGSEGV, SIGBUS, SIGILL, SIGFPE and
// SIGABRT that write the crashing thread's native frames (and the shared objects that hold them)
// to stderr, then run whatever handler was there before (faulthandler's, or the default), so the
// process still dies of the same signal. Off by default: a library does not take a process's
// signals unasked.
#pragma once

namespace strata::python {

// Installs the handlers when STRATA_NATIVE_BACKTRACE is set to a non-empty value other than "0".
// Returns whether it did.
bool MaybeInstallNativeBacktrace();

}  // namespace strata::python
