# q4_add_library(NAME DIR DEPS...): a static library from DIR/src/*.cpp (and DIR/src/*.cu when
# CUDA kernels are enabled), public headers in DIR/include. Sources are globbed so that adding a
# file needs no CMake edit.
function(q4_add_library name dir)
  file(GLOB _cpp CONFIGURE_DEPENDS ${dir}/src/*.cpp)
  set(_srcs ${_cpp})
  if(Q4_WITH_CUDA)
    file(GLOB _cu CONFIGURE_DEPENDS ${dir}/src/*.cu)
    list(APPEND _srcs ${_cu})
  endif()
  if(NOT _srcs)
    message(STATUS "q4: ${name} has no sources yet; skipped")
    return()
  endif()
  add_library(${name} STATIC ${_srcs})
  target_include_directories(${name} PUBLIC ${dir}/include PRIVATE ${dir}/src)
  target_link_libraries(${name} PUBLIC ${TORCH_LIBRARIES} fmt::fmt-header-only PRIVATE q4_warnings)
  target_link_libraries(${name} PUBLIC ${ARGN})
  if(Q4_WITH_CUDA)
    target_compile_definitions(${name} PUBLIC Q4_WITH_CUDA=1)
    target_link_libraries(${name} PUBLIC CUDA::cudart)
    set_target_properties(${name} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF)
    target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>)
  endif()
  if(Q4_HAVE_NVTX)
    target_compile_definitions(${name} PUBLIC Q4_HAVE_NVTX=1)
    target_include_directories(${name} PUBLIC ${Q4_NVTX3_INCLUDE})
  endif()
  q4_use_pch(${name})
endfunction()

# Precompiled LibTorch headers: a TU that includes <torch/torch.h> costs ~30 s otherwise. One
# PCH is built once (target q4_pch) and reused by every target. No target sets
# POSITION_INDEPENDENT_CODE: GCC rejects a PCH built with -fPIC in a -fPIE compile, so everything
# uses the compiler's default (PIE on Debian) and the flags match.
if(Q4_USE_PCH)
  set(_anchor ${CMAKE_BINARY_DIR}/q4_pch_anchor.cpp)
  if(NOT EXISTS ${_anchor})
    file(WRITE ${_anchor} "// Anchor translation unit for the shared precompiled header.\n")
  endif()
  add_library(q4_pch OBJECT ${_anchor})
  target_link_libraries(q4_pch PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(q4_pch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>)
endif()

function(q4_use_pch target)
  if(Q4_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM q4_pch)
  endif()
endfunction()

# q4_add_test(NAME LABELS SOURCES... LINK libs...): one gtest binary, registered with ctest.
function(q4_add_test name)
  cmake_parse_arguments(T "" "" "LABELS;SOURCES;LINK" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LINK} GTest::gtest GTest::gtest_main q4_warnings)
  target_compile_definitions(${name} PRIVATE
    Q4_FIXTURES_DIR="${PROJECT_SOURCE_DIR}/tests/fixtures"
    Q4_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    Q4_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  q4_use_pch(${name})
  include(GoogleTest)
  gtest_discover_tests(${name} PROPERTIES LABELS "${T_LABELS}" DISCOVERY_TIMEOUT 120)
endfunction()

# q4_add_library_tests(LIB [TOOLS tool...]): test_LIB from tests/LIB/*_test.cpp (label cpu) and,
# when tests/LIB/cuda/ has tests, test_LIB_cuda (label cuda; its tests skip without a GPU). Both
# link q4_LIB only. TOOLS are executables the tests run, built before the test binary.
function(q4_add_library_tests lib)
  cmake_parse_arguments(T "" "" "TOOLS" ${ARGN})
  if(NOT TARGET q4_${lib})
    return()
  endif()
  file(GLOB _cpu CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*_test.cpp)
  if(_cpu)
    q4_add_test(test_${lib} LABELS cpu SOURCES ${_cpu} LINK q4_${lib})
    foreach(tool ${T_TOOLS})
      if(TARGET ${tool})
        add_dependencies(test_${lib} ${tool})
      endif()
    endforeach()
  endif()
  file(GLOB _cuda CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/cuda/*_test.cpp)
  if(_cuda)
    q4_add_test(test_${lib}_cuda LABELS cuda SOURCES ${_cuda} LINK q4_${lib})
  endif()
endfunction()
