// port_file.h: how servers tell tests and scripts which port they bound (--port-file).
#ifndef FUSEDPS_COMMON_PORT_FILE_H_
#define FUSEDPS_COMMON_PORT_FILE_H_

#include <cstdio>
#include <fstream>
#include <string>

namespace fusedps {

// Writes the port and a newline to a temporary file and renames it over `path`, so readers
// never see a partial file. Returns false when either step fails.
inline bool WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << port << "\n";
    if (!out) return false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

}  // namespace fusedps

#endif  // FUSEDPS_COMMON_PORT_FILE_H_
