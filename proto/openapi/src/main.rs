//! Prints the OpenAPI description of the OtterScale API's Connect endpoints
//! (`make proto` writes it to `openapi/openapi.yaml`).

fn main() -> anyhow::Result<()> {
    print!("{}", otter_openapi::generate()?);
    Ok(())
}
