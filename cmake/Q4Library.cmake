# q4_add_library(NAME DIR DEPS...): a static library from DIR/src/*.cpp (and DIR/src/*.cu when
# CUDA kernels are enabled), public headers in DIR/include. Sources are globbed so that adding a
# file needs no CMake edit.
function(q4_add_library name dir)
  file(GLOB_RECURSE _cpp CONFIGURE_DEPENDS ${dir}/src/*.cpp)
  set(_srcs ${_cpp})
  if(Q4_WITH_CUDA)
    file(GLOB_RECURSE _cu CONFIGURE_DEPENDS ${dir}/src/*.cu)
    # Kernels compile alone: nvcc's time goes to code generation, not to headers.
    set_source_files_properties(${_cu} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
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
endfunction()

# q4_add_test(NAME LABELS labels... SOURCES... LINK libs... [SLOW Suite.Case...]): one gtest
# binary linking q4_test_support, registered with ctest per gtest suite by Q4TestSuites.cmake after
# each link: LABELS (unit or e2e; the former label cpu reads as unit) on a suite's cases, cuda
# added on its CUDA cases, and each SLOW case registered alone with label slow.
set(Q4_TEST_SUITES_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/Q4TestSuites.cmake)
set(Q4_TEST_COSTS ${PROJECT_SOURCE_DIR}/tests/ctest_costs.txt)
function(q4_add_test name)
  cmake_parse_arguments(T "" "" "LABELS;SOURCES;LINK;SLOW" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LINK} q4_test_support GTest::gtest GTest::gtest_main
    q4_warnings)
  target_compile_options(${name} PRIVATE ${Q4_TEST_OPT})
  target_compile_definitions(${name} PRIVATE
    Q4_FIXTURES_DIR="${PROJECT_SOURCE_DIR}/tests/fixtures"
    Q4_SOURCE_DIR="${PROJECT_SOURCE_DIR}"
    Q4_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  # LINK_DEPENDS: a change of the costs or of the registering script relinks, which rewrites the
  # ctest file.
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests
    LINK_DEPENDS "${Q4_TEST_COSTS};${Q4_TEST_SUITES_SCRIPT}")
  list(TRANSFORM T_LABELS REPLACE "^cpu$" "unit")
  list(JOIN T_LABELS "," _labels)
  list(JOIN T_SLOW "," _slow)
  set(_tests ${CMAKE_CURRENT_BINARY_DIR}/${name}_suites.cmake)
  add_custom_command(TARGET ${name} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -D EXE=$<TARGET_FILE:${name}> -D OUT=${_tests}
      -D WORKDIR=${CMAKE_CURRENT_BINARY_DIR} -D LABELS=${_labels} -D SLOW=${_slow}
      -D COSTS=${Q4_TEST_COSTS} -P ${Q4_TEST_SUITES_SCRIPT}
    BYPRODUCTS ${_tests} VERBATIM)
  set(_include ${CMAKE_CURRENT_BINARY_DIR}/${name}_include.cmake)
  file(WRITE ${_include} "if(EXISTS \"${_tests}\")\n  include(\"${_tests}\")\nelse()\n"
    "  add_test(${name}_NOT_BUILT ${name}_NOT_BUILT)\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${_include})
endfunction()

# q4_add_library_tests(LIB [TOOLS tool...] [SLOW Suite.Case...]): test_LIB from tests/LIB/*_test.cpp
# and tests/LIB/cuda/*_test.cpp (label unit; CUDA cases also cuda and skip without a GPU), linking
# q4_LIB only. TOOLS are executables the tests run, built before the test binary.
function(q4_add_library_tests lib)
  cmake_parse_arguments(T "" "" "TOOLS;SLOW" ${ARGN})
  if(NOT TARGET q4_${lib})
    return()
  endif()
  file(GLOB _src CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*_test.cpp
    ${CMAKE_CURRENT_SOURCE_DIR}/cuda/*_test.cpp)
  if(NOT _src)
    return()
  endif()
  q4_add_test(test_${lib} LABELS unit SOURCES ${_src} LINK q4_${lib} SLOW ${T_SLOW})
  foreach(tool ${T_TOOLS})
    if(TARGET ${tool})
      add_dependencies(test_${lib} ${tool})
    endif()
  endforeach()
endfunction()

# q4_use_precompiled_header(DIR): every static library and executable defined in DIR and below
# reuses one precompiled header of the heavy third-party headers most sources include (ATen,
# nlohmann/json, fmt): target q4_pch; the test binaries and their support library reuse
# q4_pch_test, the same plus GoogleTest. C++ sources only. A target whose flags made the header
# unusable still compiles: GCC then parses the headers itself and says so (-Winvalid-pch).
function(q4_use_precompiled_header dir)
  if(NOT TARGET q4_pch)
    set(_headers ATen/ATen.h nlohmann/json.hpp fmt/format.h)
    q4_pch_target(q4_pch "${_headers}" ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json
      fmt::fmt-header-only)
    if(TARGET GTest::gtest)
      q4_pch_target(q4_pch_test "${_headers};gtest/gtest.h" ${TORCH_LIBRARIES}
        nlohmann_json::nlohmann_json fmt::fmt-header-only GTest::gtest)
      target_compile_options(q4_pch_test PRIVATE ${Q4_TEST_OPT})
    endif()
  endif()
  get_property(_targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t ${_targets})
    get_target_property(_type ${t} TYPE)
    if(NOT (_type STREQUAL "STATIC_LIBRARY" OR _type STREQUAL "EXECUTABLE") OR t MATCHES "^q4_pch")
      continue()
    endif()
    if(t STREQUAL q4_test_support)  # no torch headers: the header would only cost its loading
      continue()
    elseif(TARGET q4_pch_test AND t MATCHES "^test_")
      target_precompile_headers(${t} REUSE_FROM q4_pch_test)
    else()
      target_precompile_headers(${t} REUSE_FROM q4_pch)
    endif()
  endforeach()
  get_property(_dirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(d ${_dirs})
    q4_use_precompiled_header(${d})
  endforeach()
endfunction()

function(q4_pch_target name headers)
  file(WRITE ${CMAKE_BINARY_DIR}/${name}.cpp "// The source of a precompiled header's target.\n")
  add_library(${name} STATIC ${CMAKE_BINARY_DIR}/${name}.cpp)
  target_link_libraries(${name} PRIVATE ${ARGN})
  foreach(h ${headers})
    target_precompile_headers(${name} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:<${h}>>")
  endforeach()
endfunction()
