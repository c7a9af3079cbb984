// Python module: {FFI target name: capsule of its handler}. jaxfox/_ffi.py registers each one.
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"
#include "targets.h"

namespace nb = nanobind;

NB_MODULE(_jaxfox_cuda, m) {
  m.def("targets", []() {
    nb::dict d;
#define JAXFOX_TARGET(name) d[#name] = nb::capsule(reinterpret_cast<void*>(&name));
    JAXFOX_TARGETS(JAXFOX_TARGET)
#undef JAXFOX_TARGET
    return d;
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
}
