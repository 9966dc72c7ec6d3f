# fusedps_cc_test(NAME SOURCES file... LIBS lib... [DEFINITIONS def...] [ARGS arg...]
#                 LABELS label... [TIMEOUT seconds])
#
# A C++ test in one call: the executable NAME from SOURCES, linked with LIBS (privately), built
# with the project's warnings (FUSEDPS_WARNINGS: -Werror), with DEFINITIONS as private compile
# definitions; the ctest test NAME runs it with ARGS and carries LABELS (unit, integration,
# stress, gpu... : .ci/run and tests/sanitizers/label_targets.py pick tests by label) and, when
# given, a TIMEOUT in seconds. Anything else a test needs (another property, a dependency) goes
# in calls after it on the same NAME.
function(fusedps_cc_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "SOURCES;LIBS;DEFINITIONS;ARGS;LABELS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "fusedps_cc_test(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_SOURCES OR NOT arg_LABELS)
    message(FATAL_ERROR "fusedps_cc_test(${name}): SOURCES and LABELS are required")
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE ${arg_LIBS})
  target_compile_options(${name} PRIVATE ${FUSEDPS_WARNINGS})
  if(arg_DEFINITIONS)
    target_compile_definitions(${name} PRIVATE ${arg_DEFINITIONS})
  endif()
  add_test(NAME ${name} COMMAND ${name} ${arg_ARGS})
  _fusedps_test_properties(${name} "${arg_LABELS}" "${arg_TIMEOUT}")
endfunction()

# fusedps_pytest(NAME ARGS arg... ENVIRONMENT var=value... LABELS label... [TIMEOUT seconds])
#
# A pytest run in one call: ctest test NAME runs FUSEDPS_PYTHON -m pytest -q (no cache
# directory) with ARGS (test files, folders, options), from the tree's root, with ENVIRONMENT,
# LABELS and, when given, a TIMEOUT in seconds. Other properties go in calls after it on the
# same NAME.
function(fusedps_pytest name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "ARGS;ENVIRONMENT;LABELS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "fusedps_pytest(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_ARGS OR NOT arg_LABELS)
    message(FATAL_ERROR "fusedps_pytest(${name}): ARGS and LABELS are required")
  endif()
  add_test(NAME ${name} COMMAND ${FUSEDPS_PYTHON} -m pytest -q -p no:cacheprovider ${arg_ARGS}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${arg_ENVIRONMENT}")
  _fusedps_test_properties(${name} "${arg_LABELS}" "${arg_TIMEOUT}")
endfunction()

# The LABELS and, when not empty, the TIMEOUT of test `name` (both helpers above).
function(_fusedps_test_properties name labels timeout)
  set_tests_properties(${name} PROPERTIES LABELS "${labels}")
  if(timeout)
    set_tests_properties(${name} PROPERTIES TIMEOUT ${timeout})
  endif()
endfunction()
