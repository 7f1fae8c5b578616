// Check messages of csrc/'s torch entries (bindings.cpp, gemm_sm90/binding.cpp): MOE_CHECK(cond, parts...).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

// Error messages are built with std::string and std::to_string only, never with std::ostream
// (which TORCH_CHECK's c10::str uses for anything but one string). Why: on the H200 image the
// built library carried its own copy of libstdc++'s stream code, whose locale facets are never
// initialised; the first `<< int64_t` in a failing check dereferenced a null facet and killed the
// process (SIGSEGV in std::ostream::_M_insert<long>, bench/NOTES.md). Messages made here reach
// TORCH_CHECK as one std::string, which c10 passes through untouched, and the c10::Error is built
// inside libc10 with its own (initialised) library.
namespace moe {
namespace msg {
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& out, T value) {
  out += std::to_string(value);
}
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }  // formatted in libc10
inline void append(std::string& out, c10::ScalarType type) { out += c10::toString(type); }
}  // namespace msg

template <class... Args>
std::string message(const Args&... args) {
  std::string out;
  (msg::append(out, args), ...);
  return out;
}
}  // namespace moe

#define MOE_CHECK(cond, ...) TORCH_CHECK(cond, ::moe::message(__VA_ARGS__))
