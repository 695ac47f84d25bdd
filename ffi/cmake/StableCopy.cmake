# pip builds every install in a fresh isolated environment (/tmp/pip-build-env-XXXX), so the paths of
# jaxlib's FFI headers and of nanobind's sources change from one `pip install -e` to the next. Compile
# commands naming those paths would differ each time and make every later install (the README's test
# command after the main job's) rebuild everything. blink_stable_copy mirrors such a directory into
# the build directory, writing a file only when its content changed, so the compile commands and the
# files' timestamps stay the same and the build directory is reused.
function(blink_stable_copy src dst out_var)
  file(GLOB_RECURSE _blink_files RELATIVE "${src}" "${src}/*")
  list(FILTER _blink_files EXCLUDE REGEX "(^|/)__pycache__/")
  foreach(_f IN LISTS _blink_files)
    get_filename_component(_dir "${dst}/${_f}" DIRECTORY)
    file(MAKE_DIRECTORY "${_dir}")
    file(COPY_FILE "${src}/${_f}" "${dst}/${_f}" ONLY_IF_DIFFERENT)
  endforeach()
  if(EXISTS "${dst}")  # files a newer version dropped
    file(GLOB_RECURSE _blink_old RELATIVE "${dst}" "${dst}/*")
    list(REMOVE_ITEM _blink_old ${_blink_files})
    foreach(_f IN LISTS _blink_old)
      file(REMOVE "${dst}/${_f}")
    endforeach()
  endif()
  set(${out_var} "${dst}" PARENT_SCOPE)
endfunction()
