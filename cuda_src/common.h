// common.h — errors and checks shared by every part of the binary.
// Every failure becomes an attnstep::Error carrying the exit status the contract promises
// (docs/contract.md): 2 bad usage or input, 3 not enough memory, 1 internal or CUDA failure.
// main() catches it, prints one line, removes nothing it did not write, and exits.
#pragma once

#include <stdexcept>
#include <string>

namespace attnstep {

enum ExitCode : int { kExitOk = 0, kExitInternal = 1, kExitBadInput = 2, kExitNoMemory = 3 };

struct Error : std::runtime_error {
    int exit_code;
    std::string hint;  // printed as "HINT: ..." on its own line when not empty
    Error(int code, const std::string& what, const std::string& hint_ = "")
        : std::runtime_error(what), exit_code(code), hint(hint_) {}
};

[[noreturn]] inline void fail(int code, const std::string& what, const std::string& hint = "") {
    throw Error(code, what, hint);
}

// "1 head", "2 heads": every count a user reads, with its noun in the right number
// (`nouns` for a plural that is not noun + "s").
inline std::string plural(long long n, const std::string& noun, const std::string& nouns = "") {
    return std::to_string(n) + " " + (n == 1 ? noun : (nouns.empty() ? noun + "s" : nouns));
}

// "file:line" of the caller, for check macros.
inline std::string where(const char* file, int line) {
    return std::string(file) + ":" + std::to_string(line);
}

}  // namespace attnstep
